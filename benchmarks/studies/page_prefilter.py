"""Would a page-level pre-filter keep TokenSelect's choice? (issue 55: a mode that reads every key each step is capped
near 1.2x Full KV at 16 rows by the memory floor; reading page summaries first and token keys only in the best pages
would go past it.)

A Full-KV generation on real weights records, at each decode step, layer and KV head, TokenSelect's token criticality
(each query head's softmax over the cached tokens, summed over the heads of the KV group: the soft vote) and its top-k
(k = `--budget` of the context). It then ranks the cache's pages (`--page` tokens) by Quest's upper bound of q . k
from each page's per-channel key minimum and maximum (the largest over the group's query heads) and keeps the best
P = m x k / page pages for each multiple m of `--multiples`. Reported per m: the share of the exact top-k tokens that
lie in the kept pages (token recall) and the share of their soft-vote mass (mass recall), mean and 5th percentile over
steps, layers and KV heads, and the share of key bytes read (page summaries: 2 / page of a key each; then the kept
pages' keys). Nothing in the engine changes: the recording method attends to every token.

    PYTHONPATH=$PWD python benchmarks/studies/page_prefilter.py --model qwen.gguf --data ../shared/data \
        --context 8192 --out benchmarks/results/page_prefilter.json
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

import semkv
from semkv.engine.hooks import DecodeBatch, KVMethod
from semkv.kernels.reference import min_max_bound

NEEDLE = "The special magic number for the blue lighthouse is 4172093."
QUESTION = "What is the special magic number for the blue lighthouse? Answer with the number only."


@dataclass
class Recorder(KVMethod):
    """Full KV that measures, in `select`, what a page pre-filter would keep of TokenSelect's top-k."""

    share: float = 0.1  # TokenSelect's top-k as a share of the context (the method itself attends to every token)
    page: int = 16
    multiples: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0)
    rows: list[dict] = field(default_factory=list)

    graph_safe = False  # eager steps, with the batch's sequences

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor):
        kv_heads = batch.pool.num_kv_heads
        group = q.shape[1] // kv_heads
        for b, seq in enumerate(batch.seqs):
            keys = seq.kv.keys(layer).float()  # [kv_heads, n, D]
            for h in range(kv_heads):
                self.rows.append(dict(layer=layer, **measure(q[b, h * group:(h + 1) * group].float(), keys[h],
                                                            self.share, self.page, self.multiples)))
        return None


def measure(q: torch.Tensor, keys: torch.Tensor, share: float, page: int, multiples) -> dict:
    """q [group, D], keys [n, D] -> token and mass recall of the top-P pages by Quest's bound, for each multiple."""
    n, dim = keys.shape
    vote = torch.softmax(q @ keys.T / dim**0.5, dim=-1).sum(0)  # [n] the group's soft vote
    k = max(1, int(share * n))
    top = vote.topk(k).indices
    pages = -(-n // page)
    padded = torch.cat([keys, keys[-1:].expand(pages * page - n, -1)]).view(pages, page, dim)
    low, high = padded.amin(1), padded.amax(1)  # [pages, D]
    bound = min_max_bound(q[None], low[None, :, None], high[None, :, None], "max")[0, 0]  # [pages]
    order = bound.argsort(descending=True)
    out = {}
    for m in multiples:
        kept = torch.zeros(pages, dtype=torch.bool)
        kept[order[: min(pages, max(1, round(m * k / page)))]] = True
        inside = kept[top // page]
        out[f"tokens_{m}"] = inside.float().mean().item()
        out[f"mass_{m}"] = (vote[top][inside].sum() / vote[top].sum()).item()
        out[f"bytes_{m}"] = (2 / page + kept.float().mean().item())  # summaries, then the kept pages' keys
    return out


def prompt(data: Path, tokenizer, context: int, seed: int) -> str:
    """Essays cut to about `context` tokens with the needle at a random depth, then the question."""
    text = json.loads((data / "paul_graham" / "ruler_PaulGrahamEssays.json").read_text())["text"]
    ids = tokenizer(text[: context * 6])["input_ids"][: context - 200]
    rng = random.Random(seed)
    at = rng.randrange(len(ids) // 10, len(ids) * 9 // 10)
    return tokenizer.decode(ids[:at]) + " " + NEEDLE + " " + tokenizer.decode(ids[at:]) + "\n\n" + QUESTION


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a study that records a Full-KV generation on needle prompts (`generate`)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded model)")
    p.add_argument("--data", default="../shared/data", help="folder with paul_graham/ruler_PaulGrahamEssays.json")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="decode steps recorded per prompt")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--out", default=None, help="JSON of the summary (and the command's settings)")
    return p


def generate(args: argparse.Namespace, recorder: KVMethod) -> list[str]:
    """`args.prompts` needle prompts (`prompt`) generated on the CPU with the recording method: their answers."""
    llm = semkv.LLM(args.model, device="cpu")
    answers = []
    for i in range(args.prompts):
        out = llm.generate(prompt(Path(args.data), llm.tokenizer, args.context, i), method=recorder,
                           max_new_tokens=args.steps, allow_overlong=True)
        answers.append(out[0].text)
    return answers


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--multiples", default="1,1.5,2,3,4")
    args = p.parse_args()
    multiples = tuple(float(m) for m in args.multiples.split(","))
    recorder = Recorder(share=args.budget, page=args.page, multiples=multiples)
    answers = generate(args, recorder)
    rows = recorder.rows
    summary = dict(settings=vars(args), measurements=len(rows), answers=answers, by_multiple={})
    for m in multiples:
        tokens = sorted(r[f"tokens_{m}"] for r in rows)
        mass = sorted(r[f"mass_{m}"] for r in rows)
        summary["by_multiple"][m] = dict(
            token_recall_mean=sum(tokens) / len(tokens), token_recall_p5=tokens[len(tokens) // 20],
            mass_recall_mean=sum(mass) / len(mass), mass_recall_p5=mass[len(mass) // 20],
            key_bytes_read=sum(r[f"bytes_{m}"] for r in rows) / len(rows))
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
