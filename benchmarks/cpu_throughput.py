"""Prefill and decode tokens/s of semkv next to HF transformers (its default attention, sdpa), same weights, same
prompt ids, same machine, one run: what the set-up run costs on a CPU.

    python benchmarks/cpu_throughput.py                                  # the set-up run + a 2,048-token prompt
    python benchmarks/cpu_throughput.py --contexts 2048,8000 --no-setup --methods full

Prompts, on the embedded SmolLM2-135M-Instruct unless --model says otherwise: the set-up run's (the README's
`semkv generate` command: examples/scandal_in_bohemia.txt and its question in the chat template, about 5,088 tokens)
and, for each of --contexts, that many tokens of the same text (repeated past its end) as a plain prompt. semkv runs
each of --methods through `LLM.generate`, as `semkv generate` does, and reports its stats; HF runs one forward over
the same ids and then one per new token with its KV cache, greedy, in float32 as semkv on the CPU. Both decode
--new-tokens tokens (EOS ignored), and a rate is the tokens over the time of their steps (decode: the tokens after the
first). The machine's load average is printed and written beside the rates: other processes on the cores change
them, so compare rows of one run, and quote a run made on idle cores. Prints a markdown table; --out writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

import semkv
from semkv.bench.hf_baseline import hf_model

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT = ROOT / "examples" / "scandal_in_bohemia.txt"
QUESTION = "What is the name of the woman in this story?"  # the set-up command's


@torch.inference_mode()
def run_hf(hf, ids: list[int], new_tokens: int) -> dict:
    """HF's greedy prefill and decode of `ids`: seconds of each and the tokens."""
    started = time.perf_counter()
    out = hf(torch.tensor([ids]), use_cache=True)
    prefill_s = time.perf_counter() - started
    past, tokens = out.past_key_values, [int(torch.argmax(out.logits[0, -1]))]
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(torch.argmax(out.logits[0, -1])))
    return dict(prefill_tps=len(ids) / prefill_s, decode_tps=new_tokens / (time.perf_counter() - started),
                tokens=tokens)


def prompts(llm: semkv.LLM, contexts: list[int], setup: bool) -> list[tuple[str, str, str | None, bool]]:
    """(label, prompt, question, chat) for each measured prompt."""
    text = DOCUMENT.read_text(encoding="utf-8")
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = [("set-up run", text, QUESTION, True)] if setup else []
    while len(ids) < max(contexts, default=0):
        ids = ids + ids  # the story again, for contexts longer than it
    for n in contexts:
        out.append((f"{n} tokens", llm.tokenizer.decode(ids[:n]), None, False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded model)")
    parser.add_argument("--contexts", default="2048", help="plain prompts of these many tokens (comma-separated)")
    parser.add_argument("--setup", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the set-up run's prompt")
    parser.add_argument("--methods", default="full,quest", help="semkv methods (comma-separated)")
    parser.add_argument("--budget", default=512, type=int, help="budget of the methods other than full (512)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    llm = semkv.LLM(args.model, device="cpu")
    hf = hf_model(args.model, torch.device("cpu"), torch.float32, "sdpa")
    rows = []
    for label, prompt, question, chat in prompts(llm, [int(c) for c in args.contexts.split(",") if c], args.setup):
        for method in args.methods.split(","):
            out = llm.generate(prompt, method=method, budget=None if method == "full" else args.budget,
                               questions=None if question is None else [question], chat=chat,
                               max_new_tokens=args.new_tokens, ignore_eos=True)[0]
            rows.append(dict(prompt=label, engine="semkv", method=method, prompt_tokens=out.stats.prompt_tokens,
                             prefill_tps=out.stats.prefill_tokens_per_s, decode_tps=out.stats.decode_tokens_per_s,
                             tokens=out.token_ids))
        ref = run_hf(hf, out.prompt_token_ids, args.new_tokens)
        rows.append(dict(prompt=label, engine="HF transformers (sdpa)", method="full",
                         prompt_tokens=len(out.prompt_token_ids), **ref))
    after = os.getloadavg()
    info = dict(model=llm.source, torch=torch.__version__, threads=torch.get_num_threads(), cores=os.cpu_count(),
                cpu=platform.processor() or platform.machine(), load_before=load, load_after=after,
                new_tokens=args.new_tokens, budget=args.budget)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}; torch {info['torch']}, "
          f"{info['threads']} threads\n")
    print("| prompt | tokens | engine | method | prefill tok/s | decode tok/s | tokens as HF's |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hf_tokens = next(h["tokens"] for h in rows if h["prompt"] == r["prompt"] and h["engine"] != "semkv")
        same = "" if r["engine"] != "semkv" else ("same" if r["tokens"] == hf_tokens else "differ")
        method = r["method"] if r["method"] == "full" else f"{r['method']} @ {args.budget}"
        print(f"| {r['prompt']} | {r['prompt_tokens']} | {r['engine']} | {method} | {r['prefill_tps']:.0f} | "
              f"{r['decode_tps']:.1f} | {same} |")


if __name__ == "__main__":
    main()
