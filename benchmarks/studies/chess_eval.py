"""CHESS on the embedded model: passkey accuracy and needle retention against Quest and SnapKV at equal budgets with
the N_c / N_g ablation on the same prefills, re-selections per 100 generated tokens (dynamic vs periodic), and the
share of a decode step spent selecting at a long context.

    PYTHONPATH=. python benchmarks/studies/chess_eval.py passkey --budget 256 --lengths 2000,3500 --depths 0.1,0.3,0.5,0.7,0.9
    PYTHONPATH=. python benchmarks/studies/chess_eval.py passkey --sweep-only --lengths 1500,2500,3500 --depths 0.15,0.25,...
    PYTHONPATH=. python benchmarks/studies/chess_eval.py reselect --context 1000 --new-tokens 400 --samples 4
    PYTHONPATH=. python benchmarks/studies/chess_eval.py overhead --context 8000 --new-tokens 16

Passkey prompts hide "The pass key is N. Remember it. N is the pass key." at several depths of Paul Graham essays
(shared data, `$SEMKV_SHARED`) and ask for it; every method of a prompt starts from one shared Full-KV prefill
(`LLM.compare`). Retention: the share of the needle's tokens a method attends to, over decode steps, layers and KV
heads. Ablation: at the first decode step of the default CHESS (and of its `rope_free + center` variant), every
(N_c, N_g, preset) is evaluated on the same cache and page sums, and its needle retention recorded.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

import semkv
from semkv.methods import Chess, FullKV, Quest, SnapKV
from semkv.methods.chess.method import PRESETS

SHARED = Path(os.environ.get("SEMKV_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
ESSAYS = SHARED / "data" / "paul_graham" / "gkamradt_essays"
HAYSTACK = ("addiction", "aord", "apple", "avg", "before", "bias", "boss", "copy", "corpdev", "desres")
INTRO = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
QUESTION = "What is the pass key? Answer with the number only."
VARIANTS = {"": {}, "+rc": dict(rope_free=True, center=True)}  # the paper's scoring; RoPE undone and centred


def passkey_prompt(llm, tokens: int, depth: float, key: int, essays: Path) -> tuple[str, list[int]]:
    """A prompt of about `tokens` tokens with the needle at `depth`, and the positions of the needle's tokens."""
    words = " ".join((essays / f"{name}.txt").read_text() for name in HAYSTACK).split()[: int(tokens * 0.72)]
    cut = max(int(len(words) * depth), 1)
    while cut < len(words) and not words[cut - 1].endswith("."):  # insert at a sentence end
        cut += 1
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    prompt = INTRO + " ".join(words[:cut] + [needle] + words[cut:])
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{prompt}\n\n{QUESTION}"}],
                                             add_generation_prompt=True, tokenize=False)
    enc = llm.tokenizer(chat, add_special_tokens=False, return_offsets_mapping=True)
    lo = chat.index(needle)
    positions = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < lo + len(needle) and b > lo]
    return prompt, positions


def needle_shares(kv, layer: int, selection, needle: torch.Tensor) -> list[float]:
    """Per KV head: the share of needle positions attended (None: every stored slot, what eviction left)."""
    if selection is None:
        positions = kv.positions(layer)  # [kv_heads, n]
        return [torch.isin(needle, row).float().mean().item() for row in positions]
    slots, lengths = selection.slots[0], selection.lengths[0]  # [S, n], [S]
    positions = kv.gather(layer, slots)[2]  # [kv_heads, n]
    shared = slots.shape[0] == 1
    return [torch.isin(needle, positions[h, : int(lengths[0 if shared else h])]).float().mean().item()
            for h in range(positions.shape[0])]


def track_needle(method, needle: torch.Tensor, log: list[float]):
    """`method` in a subclass that records the needle shares of every decode step and layer into `log`: from the
    per-layer `select`, or from the once-per-step `plan_selection` (CHESS), which then serves every layer. A subclass,
    because the engine runs a bound copy of the method (`KVMethod.bound`): attributes set on the object are not
    copied, its class and fields are."""

    class Tracked(type(method)):
        def select(self, layer, batch, q):
            selection = super().select(layer, batch, q)
            log.extend(needle_shares(batch.seqs[0].kv, layer, selection, needle))
            return selection

        def plan_selection(self, batch, plan):
            selection = super().plan_selection(batch, plan)
            for layer in range(batch.num_slots.shape[1]):
                log.extend(needle_shares(batch.seqs[0].kv, layer, selection, needle))
            return selection

    Tracked.__name__ = type(method).__name__
    return Tracked(**{f.name: getattr(method, f.name) for f in fields(method) if f.init})


@dataclass
class Sweep(Chess):
    """CHESS that, at its first decode step, also evaluates every configuration of `grid` (same rope_free, so they
    share its page sums) on its own cache and records the needle share each would attend to."""

    grid: dict = field(default_factory=dict)  # name -> Chess
    needle: torch.Tensor | None = None
    found: dict = field(default_factory=dict)

    def step_plan(self, batch):
        if not self.found:
            seq = batch.seqs[0]
            own = seq.method_state
            for name, m in self.grid.items():
                m.bind(self.model, self.tokenizer, self.kv_page_size)
                m.summaries, seq.method_state = self.summaries, m.new_state(seq)
                seq.method_state.summarized = own.summarized
                plan = m.step_plan(batch)
                own.summarized = seq.method_state.summarized  # the shared sums were brought up to date
                selection = m.plan_selection(replace(batch, max_slots=seq.kv.num_slots[0]), plan)
                self.found[name] = needle_shares(seq.kv, 0, selection, self.needle)[0]
            seq.method_state = own
        return super().step_plan(batch)


def prompts(llm, args):
    rng = random.Random(0)
    for tokens, depth in itertools.product(args.lengths, args.depths):
        key = rng.randrange(10000, 99999)
        yield tokens, depth, key, *passkey_prompt(llm, tokens, depth, key, args.essays)


def run_passkey(llm, args) -> dict:
    budget, rows, ablation = args.budget, {}, {}
    grid = list(itertools.product(args.chunk_pages, args.grid_chunks, PRESETS))
    for tokens, depth, key, prompt, needle in prompts(llm, args):
        needle = torch.tensor(needle)
        named = {} if args.sweep_only else {"full": FullKV(), "quest": Quest(budget=budget),
                                            "snapkv": SnapKV(budget=budget)}
        for v, kw in VARIANTS.items():
            sweep = {f"{p}{v} N_c={c} N_g={g}": Chess(budget=budget, preset=p, chunk_pages=c, grid_chunks=g, **kw)
                     for c, g, p in grid}
            for p in PRESETS if not args.sweep_only else ["moderate"]:
                named[f"chess-{p}{v}"] = (Sweep(budget=budget, preset=p, grid=sweep, needle=needle, **kw)
                                          if p == "moderate" else Chess(budget=budget, preset=p, **kw))
        logs = {name: [] for name in named}
        named = {name: track_needle(m, needle, logs[name]) for name, m in named.items()}
        new_tokens = 2 if args.sweep_only else args.new_tokens  # the sweep needs one decode step
        outs = llm.compare(prompt, list(named.values()), question=QUESTION, max_new_tokens=new_tokens)
        for (name, m), out in zip(named.items(), outs):
            row = rows.setdefault(name, {"correct": 0, "retention": 0.0, "attended": 0.0, "prompts": 0})
            row["correct"] += str(key) in out.text
            row["retention"] += sum(logs[name]) / len(logs[name])
            row["attended"] += out.stats.kv_attended_tokens
            row["prompts"] += 1
            print(f"{tokens} {depth:.1f} {name:<20} {str(key) in out.text!s:<5} {sum(logs[name]) / len(logs[name]):.2f}"
                  f" {out.text[:30]!r}", flush=True)
            for config, share in getattr(m, "found", {}).items():
                ablation.setdefault(config, []).append(share)
    table = {name: {"accuracy": r["correct"] / r["prompts"], "needle_retention": r["retention"] / r["prompts"],
                    "attended_tokens": r["attended"] / r["prompts"], "prompts": r["prompts"]}
             for name, r in rows.items()}
    return {"methods": table, "ablation_first_step_retention": {k: sum(v) / len(v) for k, v in ablation.items()}}


def essay_prompts(args) -> list[str]:
    names = ["worked", "popular", "gap", "gh", "love", "philosophy"][: args.samples]
    return [" ".join((args.essays / f"{n}.txt").read_text().split()[: int(args.context * 0.72)]) for n in names]


def run_reselect(llm, args) -> dict:
    """Re-selections per 100 generated tokens over free generations after essays (one batch per mode)."""
    out = {}
    for mode in ("dynamic", "periodic"):
        method, pages = Chess(budget=args.budget, mode=mode), []
        inner = method.uncertain  # called with each generated page's mean entropy and varentropy (dynamic mode)
        method.uncertain = lambda mean, var: pages.append((mean, var)) or inner(mean, var)
        outs = llm.generate(essay_prompts(args), method=method,
                            questions=["Summarize the essay above in detail."] * args.samples,
                            max_new_tokens=args.new_tokens, ignore_eos=True)
        reselections = sum(o.stats.extra["reselections"] for o in outs)
        generated = sum(o.stats.new_tokens for o in outs)
        out[mode] = {"reselections": reselections, "generated": generated,
                     "per_100_tokens": 100 * reselections / generated,
                     "per_sequence": [o.stats.extra["reselections"] for o in outs]}
        if pages:
            stats = torch.tensor(pages)  # [pages, 2]
            out[mode]["pages"] = len(pages)
            out[mode]["thresholds"] = list(method.thresholds)
            out[mode]["page_mean_entropy_max_median"] = [stats[:, 0].max().item(), stats[:, 0].median().item()]
            out[mode]["page_varentropy_max_median"] = [stats[:, 1].max().item(), stats[:, 1].median().item()]
        print(mode, json.dumps(out[mode]), flush=True)
    return out


def run_overhead(llm, args) -> dict:
    """Selection time as a share of decode time: the engine's selection time (per-layer `select` plus the
    once-per-step `step_plan` and `plan_selection`, where CHESS runs its cascade), and CHESS's end-of-step bookkeeping
    (entropy)."""
    text = " ".join((args.essays / f"{name}.txt").read_text() for name in HAYSTACK + ("worked",))
    prompt = " ".join(text.split()[: int(args.context * 0.72)])
    named = {"full": FullKV(), "quest": Quest(budget=args.budget), "chess-dynamic": Chess(budget=args.budget),
             "chess-always": Chess(budget=args.budget, mode="always")}
    end_s = {name: 0.0 for name in named}
    for name, m in named.items():
        if isinstance(m, Chess):
            def timed(batch, logits, tokens, inner=m.end_step, name=name):
                started = time.perf_counter()
                inner(batch, logits, tokens)
                end_s[name] += time.perf_counter() - started

            m.end_step = timed
    outs = llm.compare(prompt, list(named.values()), question="Summarize the text above.",
                       max_new_tokens=args.new_tokens)
    table = {}
    for (name, m), o in zip(named.items(), outs):
        s = o.stats
        table[name] = {"context": s.prompt_tokens, "new_tokens": s.new_tokens, "decode_s": s.decode_s,
                       "selection_share": s.selection_s / s.decode_s, "end_step_share": end_s[name] / s.decode_s,
                       "reselections": s.extra.get("reselections", 0), "attended": s.kv_attended_tokens}
        print(name, json.dumps(table[name]), flush=True)
    return table


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["passkey", "reselect", "overhead"])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--essays", type=Path, default=ESSAYS)
    p.add_argument("--lengths", type=ints, default=[2000, 3000])
    p.add_argument("--depths", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.5, 0.8])
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--chunk-pages", type=ints, default=[2, 4, 8])
    p.add_argument("--grid-chunks", type=ints, default=[2, 4, 8])
    p.add_argument("--new-tokens", type=int, default=10)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--sweep-only", action="store_true", help="passkey: only the N_c / N_g ablation (no decoding)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = semkv.LLM(args.model, device=args.device)
    started = time.perf_counter()
    result = {"passkey": run_passkey, "reselect": run_reselect, "overhead": run_overhead}[args.part](llm, args)
    print(json.dumps(result, indent=2))
    print(f"{args.part}: {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "result": result},
                                       indent=2))


if __name__ == "__main__":
    main()
