"""Prefill and decode tokens/s of semkv (Full KV) next to HF transformers, same weights, same machine, one run.

    python benchmarks/cpu_throughput.py --contexts 2048,8192 --new-tokens 64 [--model PATH] [--device cpu]

Both engines get the same token ids (real text, cut to the context length) and decode greedily; HF runs its own
prefill (one forward over the prompt) and then one forward per token with its KV cache, as `generate` does. Prints a
markdown table and writes JSON next to it (--out).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import FullKV

ROOT = Path(__file__).resolve().parents[1]


def text_ids(llm: semkv.LLM, n: int) -> list[int]:
    books = ROOT.parent / "shared" / "data" / "books" / "pg1661_adventures_of_sherlock_holmes.txt"
    source = books if books.is_file() else ROOT / "examples" / "scandal_in_bohemia.txt"
    text = source.read_text(encoding="utf-8-sig")
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def run_semkv(llm: semkv.LLM, ids: list[int], new_tokens: int) -> dict:
    engine, method = llm.engine, FullKV()
    seq = Sequence(0, ids, SamplingParams(max_new_tokens=new_tokens), SeqKV(engine.pool))
    started = time.perf_counter()
    logits = engine.prefill(seq, method)
    sync(engine.device)
    prefill_s = time.perf_counter() - started
    tokens = []
    started = time.perf_counter()
    for _ in range(new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        seq.output_ids.append(token)
        logits = engine.decode_step([seq], method)[0]
    sync(engine.device)
    decode_s = time.perf_counter() - started
    seq.kv.release()
    return dict(prefill_s=prefill_s, decode_s=decode_s, tokens=tokens)


@torch.inference_mode()
def run_hf(hf, ids: list[int], new_tokens: int, device: torch.device) -> dict:
    started = time.perf_counter()
    out = hf(torch.tensor([ids], device=device), use_cache=True)
    sync(device)
    prefill_s = time.perf_counter() - started
    past, logits, tokens = out.past_key_values, out.logits[0, -1], []
    started = time.perf_counter()
    for _ in range(new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        out = hf(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    sync(device)
    decode_s = time.perf_counter() - started
    return dict(prefill_s=prefill_s, decode_s=decode_s, tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_throughput.json"))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from semkv.models.loader import _gguf_to_folder, embedded_model_path

    llm = semkv.LLM(args.model, device=args.device)
    source = Path(args.model) if args.model else embedded_model_path()
    folder = _gguf_to_folder(source) if source.is_file() else source
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(llm.engine.device).eval()
    rows = []
    for n in (int(c) for c in args.contexts.split(",")):
        ids = text_ids(llm, n - args.new_tokens)
        ours, ref = run_semkv(llm, ids, args.new_tokens), run_hf(hf, ids, args.new_tokens, llm.engine.device)
        rows.append(dict(context=n, prompt_tokens=len(ids), new_tokens=args.new_tokens,
                         semkv_prefill_tps=len(ids) / ours["prefill_s"], hf_prefill_tps=len(ids) / ref["prefill_s"],
                         semkv_decode_tps=args.new_tokens / ours["decode_s"],
                         hf_decode_tps=args.new_tokens / ref["decode_s"], same_tokens=ours["tokens"] == ref["tokens"]))
    info = dict(device=str(llm.engine.device), torch=torch.__version__, threads=torch.get_num_threads(),
                model=llm.source)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(info=info, rows=rows), indent=2))
    print(f"device {info['device']}, torch {info['torch']}, {info['threads']} threads, model {info['model']}\n")
    print("| context | prefill tok/s semkv | prefill tok/s HF | decode tok/s semkv | decode tok/s HF | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['semkv_prefill_tps']:.0f} | {r['hf_prefill_tps']:.0f} | "
              f"{r['semkv_decode_tps']:.1f} | {r['hf_decode_tps']:.1f} | {r['same_tokens']} |")


if __name__ == "__main__":
    main()
