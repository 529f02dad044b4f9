"""Which layers could attend to another layer's TokenSelect choice? (issue 55: `reuse_layers=N` selects in the first
layer of each group of N layers; on RULER NIAH it lost 15 points at N = 3 and as many at 2, benchmarks/results/
2026-12-03-h200-layer-reuse.md. Reusing only where a layer's choice serves the next one too would keep part of the
speed: this measures where that holds.)

A Full-KV generation on real weights records, at each decode step and layer, TokenSelect's choice (the initial and
recent slots of the budget's split and the top-k of the soft vote over every head of the layer, Eq. 7, among the
slots between them) and the layer's attention (each query head's softmax of q . k / sqrt(D), averaged over the
heads). Reported per layer, averaged over steps and prompts: the attention mass that the layer's own choice keeps,
the mass that the previous layer's choice keeps, and the mass kept under `reuse_layers` = 2 and 3 (the choice of the
layer's group's first layer). Nothing in the engine changes: the recording method attends to every token.

    PYTHONPATH=$PWD python benchmarks/studies/tokenselect_layer_reuse.py --model qwen.gguf --data ../shared/data \
        --context 8192 --out benchmarks/results/tokenselect_layer_reuse.json
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from semkv.engine.hooks import DecodeBatch, KVMethod
from semkv.methods.tokenselect.reference import split_parts
from page_prefilter import generate, parser

GROUPS = (2, 3)  # the reuse_layers measured besides 1


@dataclass
class Recorder(KVMethod):
    """Full KV that records, in `select`, each layer's TokenSelect choice and attention of a one-row batch."""

    share: float = 0.1  # TokenSelect's budget as a share of the context (the method itself attends to every token)
    n_sink: int = 128
    n_recent: int = 512
    chosen: list[torch.Tensor] = field(default_factory=list)  # this step's choices so far, bool [n] a layer
    attention: list[torch.Tensor] = field(default_factory=list)  # this step's head-mean attention, [n] a layer
    rows: list[dict] = field(default_factory=list)  # a step's masses a layer

    graph_safe = False  # eager steps, with the batch's sequences

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor):
        seq = batch.seqs[0]
        n = seq.kv.num_slots[layer]
        keys = seq.kv.keys(layer).float()  # [kv_heads, n, D]
        heads, dim = q.shape[1], q.shape[2]
        keys = keys.repeat_interleave(heads // keys.shape[0], dim=0)  # [heads, n, D]
        logits = torch.einsum("hd,hnd->hn", q[0].float(), keys)  # [heads, n]
        sink, k, recent = split_parts(torch.tensor([int(self.share * n)]), self.n_sink, self.n_recent)[0].tolist()
        vote = torch.softmax(logits[:, sink:n - recent], dim=-1).sum(0)  # Eq. 7 over the candidates
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[:sink] = chosen[n - recent:] = True
        chosen[sink + vote.topk(k).indices] = True
        if layer == 0:
            self.chosen, self.attention = [], []
        self.chosen.append(chosen)
        self.attention.append(torch.softmax(logits / dim**0.5, dim=-1).mean(0))
        if layer == len(seq.kv.table) - 1:  # the step's last layer: every layer's masses
            self.rows.append(self.masses())
        return None

    def masses(self) -> dict:
        own = [float(a[c].sum()) for a, c in zip(self.attention, self.chosen)]
        prev = [own[0]] + [float(a[c].sum()) for a, c in zip(self.attention[1:], self.chosen[:-1])]
        out = dict(own=own, previous=prev)
        for group in GROUPS:
            out[f"reuse_{group}"] = [float(a[self.chosen[layer - layer % group]].sum())
                                     for layer, a in enumerate(self.attention)]
        return out


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    recorder = Recorder(share=args.budget)
    answers = generate(args, recorder)
    rows = recorder.rows
    keys = ["own", "previous"] + [f"reuse_{g}" for g in GROUPS]
    by_layer = {key: [sum(r[key][layer] for r in rows) / len(rows) for layer in range(len(rows[0]["own"]))]
                for key in keys}
    summary = dict(settings=vars(args), steps=len(rows), answers=answers,
                   mean={key: sum(v) / len(v) for key, v in by_layer.items()}, by_layer=by_layer)
    print(f"{'layer':>5} " + " ".join(f"{key:>9}" for key in keys))
    for layer in range(len(by_layer["own"])):
        print(f"{layer:>5} " + " ".join(f"{by_layer[key][layer]:9.3f}" for key in keys))
    print(f"{'mean':>5} " + " ".join(f"{summary['mean'][key]:9.3f}" for key in keys))
    print("answers:", answers)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
