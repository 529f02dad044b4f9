"""DynSplit-KV's chunk bound against chunk length, on real weights (CPU, float32): for RULER niah_single_2 prompts at
4k (Qwen2.5-Coder-0.5B-Instruct), the query of the first decode step (the token " " the prefill answers first), per
layer and KV head, the V2F min/max bound of every DD-Select chunk (Table 7 weights: no calibration, as on the device)
and of fixed 16-token chunks; the rank of the best chunk holding needle tokens, the share of (layer, KV head) pairs
whose budget (10% of the prompt less the 16-token recent window, whole chunks in bound order) reaches a needle token
(reach) and every needle token (whole), and the Spearman correlation of a chunk's bound with its length.
Usage: python dynsplit_bias.py SAMPLES OUT.json   (the model at /tmp/qwen/qwen2.5-coder-0.5b-instruct.gguf, the RULER
data in /work/shared/data)"""
import glob
import json
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
import semkv
from semkv.eval.tasks import get_task
from semkv.methods.dynsplit.split import delimiter_candidates, table7_weight, dd_select, DEFAULT_DELIMITERS
from semkv.methods.dynsplit.v2f import block_scores, block_summaries

llm = semkv.LLM("/tmp/qwen/qwen2.5-coder-0.5b-instruct.gguf", device="cpu")
tok = llm.tokenizer
folder = glob.glob("/root/.cache/semkv/gguf/qwen2.5*")[0]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
cands = delimiter_candidates(tok, DEFAULT_DELIMITERS)
w7 = {i: table7_weight(x) for i, x in cands.items()}
task = get_task("ruler_niah_single_2", "/work/shared/data")
samples = task.samples(tok, 4096, int(sys.argv[1]), 0)
cap = {}
def hook(layer):
    def f(mod, args, kwargs):
        cap[layer] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0], kwargs["position_embeddings"])
    return f
for i, l in enumerate(model.model.layers):
    l.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
cfg = model.config
H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

def spans(ends, n):
    starts = [0] + ends
    return [(a, b) for a, b in zip(starts, ends + [n]) if b > a]

def bounds(q, k, sizes):  # q [H, D], k [KV, n, D], sizes [chunks] -> [KV, chunks]: DynSplit-KV's own V2F scores
    labels = torch.repeat_interleave(torch.arange(len(sizes)), sizes)  # [n] chunk of each token
    summaries = block_summaries(k, labels, len(sizes), "minmax")  # [2, KV, chunks, D]
    return block_scores(q[None], summaries[None], "minmax", "mean")[0]

def spearman(x, y):
    rx, ry = x.argsort().argsort().float(), y.argsort().argsort().float()
    return torch.corrcoef(torch.stack([rx, ry]))[0, 1].item()

result = []
for s in samples:
    ids, _ = llm.encode(s.context, s.question, task.chat, s.answer_prefix)
    space = tok(" ", add_special_tokens=False)["input_ids"]
    n = len(ids)
    text = tok.decode(ids)
    needle = s.needles[0]
    # the needle's token span: tokens whose decoded prefix covers the needle's characters
    start = next(i for i in range(n) if len(tok.decode(ids[:i + 1])) > text.find(needle))
    end = next(i for i in range(start, n) if len(tok.decode(ids[:i + 1])) >= text.find(needle) + len(needle)) + 1
    with torch.no_grad():
        model(torch.tensor([ids + space]))
    budget = int(0.1 * n) - 16
    rows = {}
    for mode, ends in (("dynamic", dd_select([w7.get(t, -1.0) for t in ids], 0, 16, 14, 0.5)),
                       ("fixed", list(range(16, n, 16)))):
        chunks = spans([e for e in ends if e < n], n)
        sizes = torch.tensor([b - a for a, b in chunks]).float()
        value = [c for c, (a, b) in enumerate(chunks) if a < end and b > start]  # chunks holding needle tokens
        reach, whole, ranks, corr = 0, 0, [], []
        for layer in range(cfg.num_hidden_layers):
            h, (cos, sin) = cap[layer]
            att = model.model.layers[layer].self_attn
            q = att.q_proj(h).view(1, -1, H, D).transpose(1, 2)
            k = att.k_proj(h).view(1, -1, KV, D).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            b = bounds(q[0, :, -1], k[0, :, :n], sizes.long())  # [KV, chunks]
            for head in range(KV):
                order = b[head].argsort(descending=True)
                cum = sizes[order].cumsum(0) - sizes[order]
                taken = set(order[cum < budget].tolist())
                reach += any(c in taken for c in value)
                whole += all(c in taken for c in value)
                ranks.append(min((order == c).nonzero().item() for c in value))
                corr.append(spearman(sizes, b[head]))
        pairs = cfg.num_hidden_layers * KV
        rows[mode] = dict(chunks=len(chunks), needle_chunk_tokens=[chunks[c][1] - chunks[c][0] for c in value],
                          reach=round(reach / pairs, 3), whole=round(whole / pairs, 3),
                          median_rank=sorted(ranks)[len(ranks) // 2],
                          size_bound_spearman=round(sum(corr) / len(corr), 3))
    result.append(dict(sample=s.sample_id, prompt_tokens=n, needle_tokens=[start, end], **rows))
    print(json.dumps(result[-1]), flush=True)
json.dump(result, open(sys.argv[2], "w"), indent=1)
