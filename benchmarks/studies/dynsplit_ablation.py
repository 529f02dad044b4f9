"""DynSplit-KV ablations on a passkey (needle-in-a-haystack) set: the paper's Figure 11 (without length control,
without delimiters, without weights, reversed importance order, vs full DynSplit-KV) and the base chunk size C.

Each prompt hides a 5-digit passkey at a given depth of Paul Graham essays; it is prefilled once (`LLM.compare`)
and every variant decodes from a copy of that cache at the same budget. Besides accuracy (the passkey in the
answer), the script reports a retention signal that does not depend on the model being strong: the share of the
passkey's tokens among the tokens each KV head of each layer attends to, averaged over the answer's decode steps.

    PYTHONPATH=. python benchmarks/studies/dynsplit_ablation.py --lengths 2000 3000 --depths 0.2 0.5 0.8 --budget 0.1
"""
from __future__ import annotations

from functools import partial

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

import semkv
from semkv.methods import DynSplitKV, FullKV, Quest
from semkv.methods.base import window_attention

SHARED = os.environ.get("SEMKV_SHARED") or next(
    (str(d / "shared") for d in Path(__file__).resolve().parents if (d / "shared" / "data").is_dir()), "shared")
ESSAYS = Path(SHARED) / "data" / "paul_graham" / "gkamradt_essays"
CALIBRATION_TEXTS = {"aord.txt"}  # used by `semkv calibrate` for the weights: kept out of the haystack
QUESTION = "What is the secret passkey? Answer with the number only."


def recording(cls):
    """A subclass of a selection method that records, per layer and decode step, the share of the Full-KV attention
    mass its selection keeps (all tokens), the share of the passkey's tokens in each KV head's selection, and the
    share of the Full-KV attention mass on those tokens that it keeps (heads that do not look at the needle weigh
    nothing)."""

    def select(self, layer, batch, q):
        selection = cls.select(self, layer, batch, q)
        kv, needle = batch.seqs[0].kv, self.needle.to(q.device)
        n, kv_heads = int(batch.num_slots[0, layer]), kv.pool.num_kv_heads
        mask = torch.ones(kv_heads, n, dtype=torch.bool, device=q.device)  # [kv_heads, n] attended positions
        if selection is not None:  # single sequence, device-resident: slots are positions
            slots, lengths = selection.slots[0], selection.lengths[0]
            valid = torch.arange(slots.shape[-1], device=q.device)[None] < lengths[:, None]
            picked = torch.zeros(slots.shape[0], n + 1, dtype=torch.bool, device=q.device)  # column n: padding
            mask = picked.scatter_(1, torch.where(valid, slots, n), True)[:, :n].expand(kv_heads, -1)
        probs = window_attention(q, kv.keys(layer))[:, 0]  # [heads, n] of the current query
        kept = mask.repeat_interleave(q.shape[1] // kv_heads, 0)[:, needle]  # [heads, needle]
        self.kept.append(float((probs * mask.repeat_interleave(q.shape[1] // kv_heads, 0)).sum(-1).mean()))
        self.shares.append(float(mask[:, needle].float().mean()))
        self.mass.append((float((probs[:, needle] * kept).sum()), float(probs[:, needle].sum())))
        return selection

    return type(f"Recording{cls.__name__}", (cls,), {"select": select})


def haystack(tokenizer, n_tokens: int) -> str:
    text = ""
    for path in sorted(ESSAYS.glob("*.txt")):
        if path.name not in CALIBRATION_TEXTS:
            text += path.read_text()
        if len(tokenizer(text)["input_ids"]) > n_tokens:
            break
    ids = tokenizer(text)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def build_prompt(llm, length: int, depth: float, passkey: str) -> tuple[str, torch.Tensor]:
    """The haystack with the needle inserted at a sentence start near `depth`; the prompt positions of the passkey's
    tokens (as `LLM.encode` tokenises the chat-wrapped prompt)."""
    hay = haystack(llm.tokenizer, length)
    cut = hay.find(". ", int(len(hay) * depth)) + 2
    needle = f"The secret passkey is {passkey}. Remember it. "
    doc = hay[:cut] + needle + hay[cut:]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{QUESTION}"}],
                                             add_generation_prompt=True, tokenize=False)
    enc = llm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == llm.encode(doc, QUESTION)[0]
    lo = text.find(needle) + needle.find(passkey)
    hi = lo + len(passkey)
    positions = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < hi and b > lo]
    return doc, torch.tensor(positions)


def variants(budget: float, chunk_sizes: list[int], chunk_size: int) -> dict[str, object]:
    dyn, quest = recording(DynSplitKV), recording(Quest)
    dyn = partial(dyn, count_reuse=True)  # the reuse rate column
    out = {"full": FullKV(), "quest": quest(budget=budget)}
    for c in chunk_sizes:
        out[f"dynsplit C={c}"] = dyn(budget=budget, chunk_size=c)
    out.update({
        "dynsplit": dyn(budget=budget, chunk_size=chunk_size),
        "w/o length control (alpha=1)": dyn(budget=budget, chunk_size=chunk_size, alpha=1.0),
        "w/o delimiters (fixed chunks)": dyn(budget=budget, chunk_size=chunk_size, split="fixed"),
        "w/o weights (uniform)": dyn(budget=budget, chunk_size=chunk_size, weights="uniform"),
        "reversed importance": dyn(budget=budget, chunk_size=chunk_size, weights="reversed"),
    })
    return out


def mean(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r[key] is not None]
    return f"{sum(values) / len(values):.3f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 3000], help="haystack tokens")
    p.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--chunk-size", type=int, default=DynSplitKV.chunk_size, help="C of the Figure 11 variants")
    p.add_argument("--chunk-sizes", type=int, nargs="*", default=[8, 32, 64], help="C ablation (besides --chunk-size)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write per-prompt results as JSON here")
    args = p.parse_args(argv)
    llm = semkv.LLM(args.model, device="cpu")
    rng = random.Random(args.seed)
    methods = variants(args.budget, args.chunk_sizes, args.chunk_size)
    rows = []
    for length in args.lengths:
        for depth in args.depths:
            passkey = str(rng.randint(10000, 99999))
            doc, needle = build_prompt(llm, length, depth, passkey)
            for m in methods.values():
                m.needle, m.kept, m.shares, m.mass = needle, [], [], []
            started = time.perf_counter()
            outs = llm.compare(doc, list(methods.values()), question=QUESTION, max_new_tokens=args.max_new_tokens)
            for name, m, out in zip(methods, methods.values(), outs):
                kept, shares, mass = getattr(m, "kept", []), getattr(m, "shares", []), getattr(m, "mass", [])
                rows.append(dict(length=length, depth=depth, method=name, correct=passkey in out.text,
                                 kept=sum(kept) / len(kept) if kept else None,  # None: full KV or EOS at once
                                 share=sum(shares) / len(shares) if shares else None,
                                 recall=sum(a for a, _ in mass) / sum(b for _, b in mass) if mass else None,
                                 prompt_tokens=out.stats.prompt_tokens,
                                 attended=out.stats.kv_attended_tokens, answer=out.text.strip()[:40],
                                 reused=out.stats.extra.get("kv_reused", 0),
                                 reloaded=out.stats.extra.get("kv_reloaded", 0)))
            print(f"length {length} depth {depth}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
            if args.out:  # after every prompt, so an interrupted run keeps what it measured
                Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"| method (budget {args.budget:g}) | accuracy | attention kept | needle attention kept | "
          "needle tokens attended | attended tokens | reuse rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        right = sum(r["correct"] for r in mine)
        moved = sum(r["reused"] + r["reloaded"] for r in mine)
        reuse = f"{sum(r['reused'] for r in mine) / moved:.2f}" if moved else "-"
        print(f"| {name} | {right / len(mine):.2f} ({right}/{len(mine)}) | {mean(mine, 'kept')} | "
              f"{mean(mine, 'recall')} | "
              f"{mean(mine, 'share')} | {sum(r['attended'] for r in mine) / len(mine):.0f} | {reuse} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
