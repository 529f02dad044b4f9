"""SentenceKV closing-note numbers, side by side in one run:

1. passkey retrieval (a 5-digit key hidden in Paul Graham essays at several depths and lengths) for Full KV, SnapKV
   and SentenceKV at two budgets, each method applied to one shared Full-KV prefill per prompt;
2. the retention signal: in how many (layer, KV head) pairs all tokens of the key survive prefill (SnapKV's kept
   set, SentenceKV's retained set) and, for SentenceKV, are among the attended tokens of the decode steps;
3. the latency cost of offloading: per-step decode time of SentenceKV with offload on and off (and Full KV, SnapKV),
   on one long prompt, repeated and interleaved so machine noise hits every method alike.

    PYTHONPATH=. python benchmarks/studies/sentencekv_eval.py --out sentencekv_eval.json
    PYTHONPATH=. python benchmarks/studies/sentencekv_eval.py --model /work/qwen/qwen2.5-coder-0.5b-instruct.gguf --lengths 3000
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import KVMethod, SentenceKV, SnapKV, get_method

ESSAYS = Path("/work/shared/data/paul_graham/gkamradt_essays")
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information.\n\n")
QUESTION = "What is the pass key? Answer with the number only."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "


class ProbedSentenceKV(SentenceKV):
    """SentenceKV that records, per decode step, layer and KV head, whether one whole copy of the key is attended."""

    needle: list[set[int]] = []
    hits: list[float] = []

    def select(self, layer, batch, q):
        selection = super().select(layer, batch, q)
        kv = batch.seqs[0].kv
        if selection is None:
            attended = [set(p) for p in kv.positions(layer).tolist()]
        else:
            pos = kv.gather(layer, selection.slots[0])[2]  # [kv_heads, n]
            attended = [set(pos[h, : int(selection.lengths[0, h])].tolist()) for h in range(pos.shape[0])]
        self.hits.extend(float(any(copy <= a for copy in self.needle)) for a in attended)
        return selection


def haystack(llm, n_tokens: int) -> str:
    text = "".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")))
    ids = llm.tokenizer(text[: n_tokens * 8])["input_ids"][:n_tokens]
    return llm.tokenizer.decode(ids)


def passkey_prompt(llm, n_tokens: int, depth: float, key: str) -> str:
    context = haystack(llm, n_tokens)
    cut = context.find(". ", int(len(context) * depth))
    cut = len(context) if cut < 0 else cut + 1
    return INTRO + context[:cut] + NEEDLE.format(key=key) + context[cut:]


def key_positions(llm, prompt: str, key: str) -> tuple[list[int], list[set[int]]]:
    """Token ids exactly as `LLM.encode(prompt, QUESTION)` makes them, and the token positions of each key copy."""
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{prompt}\n\n{QUESTION}"}],
                                             add_generation_prompt=True, tokenize=False)
    enc = llm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == llm.encode(prompt, QUESTION)[0]
    copies, at = [], text.find(key)
    while at >= 0:
        copies.append({i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(key) and b > at})
        at = text.find(key, at + 1)
    return enc["input_ids"], copies


def retained_share(method: KVMethod, seq: Sequence, copies: list[set[int]]) -> float | None:
    """Share of (layer, KV head) pairs in which one whole key copy survived prefill."""
    layers = range(len(seq.kv.num_slots))
    if isinstance(method, SentenceKV):
        state = seq.method_state
        if state.dense:
            return 1.0
        kept = [p for layer in layers for p in state.store.pos[layer].tolist()] if state.store else \
            [p for layer in layers for p in seq.kv.positions(layer).tolist()]
    elif isinstance(method, SnapKV):
        kept = [p for layer in layers for p in seq.kv.positions(layer).tolist()]
    else:
        return None
    return statistics.mean(float(any(c <= set(head) for c in copies)) for head in kept)


@torch.inference_mode()
def run_methods(llm, ids: list[int], question_start: int | None, methods: list[KVMethod], max_new: int,
                ignore_eos: bool, copies: list[set[int]] | None = None) -> list[dict]:
    """One Full-KV prefill, then every method from a copy of it (as `LLM.compare`, keeping each method's state)."""
    engine, pool = llm.engine, llm.engine.pool
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    base = Sequence(0, ids, params, SeqKV(pool), question_start)
    first = engine.prefill(base, get_method("full"), record_window=32)
    stop = llm._stopper(params)
    rows = []
    for method in methods:
        method.bind(llm.config, llm.tokenizer, pool.page_size)
        seq = engine.fork(base, 1)
        engine.apply_prefill(seq, method)
        share = retained_share(method, seq, copies) if copies else None
        ProbedSentenceKV.hits = []
        engine.generate([seq], method, [first], stop)
        stats = seq.stats
        steps = max(stats.new_tokens - 1, 1)
        rows.append(dict(
            method=method.name, budget=method.budget, offload=stats.extra.get("offload"),
            text=llm.tokenizer.decode(seq.output_ids, skip_special_tokens=True), retained=share,
            attended=statistics.mean(ProbedSentenceKV.hits) if ProbedSentenceKV.hits else None,
            step_ms=1000 * stats.decode_s / steps, selection_ms=1000 * stats.selection_s / steps,
            h2d_bytes_per_step=stats.h2d_bytes / steps, kv_attended=stats.kv_attended_tokens,
            kv_device_peak=stats.extra.get("kv_device_peak", stats.kv_resident_tokens)))
        seq.kv.release()
    base.kv.release()
    return rows


def passkey(llm, lengths: list[int], depths: list[float], budgets: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for n_tokens in lengths:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            prompt = passkey_prompt(llm, n_tokens, depth, key)
            ids, copies = key_positions(llm, prompt, key)
            ProbedSentenceKV.needle = copies
            methods = [get_method("full")]
            for budget in budgets:
                methods += [SnapKV(budget=budget), ProbedSentenceKV(budget=budget, offload=True)]
            for row in run_methods(llm, ids, llm.encode(prompt, QUESTION)[1], methods, 12, False, copies):
                rows.append(dict(row, length=len(ids), depth=depth, key=key, correct=key in row["text"]))
                print(json.dumps({k: rows[-1][k] for k in ("length", "depth", "method", "budget", "correct",
                                                              "retained", "attended", "text")}), flush=True)
    return rows


def latency(llm, n_tokens: int, budgets: list[int], new: int, repeats: int) -> list[dict]:
    ids = llm.encode(INTRO + haystack(llm, n_tokens), QUESTION)[0]
    rows = []
    for _ in range(repeats):
        methods = [get_method("full")]
        for budget in budgets:
            methods += [SnapKV(budget=budget), SentenceKV(budget=budget, offload=False),
                        SentenceKV(budget=budget, offload=True)]
        rows += [dict(r, length=len(ids)) for r in run_methods(llm, ids, None, methods, new, True)]
    return rows


def summarize(rows: list[dict], lat: list[dict]) -> None:
    print("\npasskey accuracy / retained / attended (mean over prompts)")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    for (name, budget), rs in groups.items():
        acc = statistics.mean(r["correct"] for r in rs)
        ret = [r["retained"] for r in rs if r["retained"] is not None]
        att = [r["attended"] for r in rs if r["attended"] is not None]
        print(f"  {name:11s} budget={budget!s:5s} accuracy={acc:.2f} ({sum(r['correct'] for r in rs)}/{len(rs)})"
              + (f" retained={statistics.mean(ret):.2f}" if ret else "")
              + (f" attended={statistics.mean(att):.2f}" if att else ""))
    if not lat:
        return
    print(f"\nper-step decode time, prompt {lat[0]['length']} tokens (median over repeats)")
    groups = {}
    for r in lat:
        groups.setdefault((r["method"], r["budget"], r["offload"]), []).append(r)
    for (name, budget, offload), rs in groups.items():
        med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
        print(f"  {name:11s} budget={budget!s:5s} offload={offload!s:5s} step={med('step_ms'):.1f} ms "
              f"selection={med('selection_ms'):.1f} ms h2d/step={med('h2d_bytes_per_step'):.0f} B "
              f"attended={med('kv_attended'):.0f} device_slots={med('kv_device_peak'):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 6000])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--latency-length", type=int, default=6000)
    parser.add_argument("--latency-steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = semkv.LLM(args.model, device=args.device)
    rows = passkey(llm, args.lengths, args.depths, args.budgets, args.seed) if args.lengths else []
    lat = latency(llm, args.latency_length, args.budgets, args.latency_steps, args.repeats) if args.repeats else []
    summarize(rows, lat)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), passkey=rows, latency=lat), indent=1))


if __name__ == "__main__":
    main()
