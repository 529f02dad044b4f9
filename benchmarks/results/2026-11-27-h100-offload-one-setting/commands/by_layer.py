"""A prefill by layer computes what a prefill chunk after chunk does, on the device: a tiny random Llama (4 layers,
bf16, CUDA graphs) with the embedded model's tokenizer, prompts of about 1,100 tokens in chunks of 128. SentenceKV and
DynSplit-KV offloaded (by layer) against resident (chunk after chunk): the prompt's logits equal exactly, the tokens
of 40 new ones equal for a batch of three, nothing held afterwards. One JSON line per method.

    python by_layer.py TOKENIZER [DEVICE]
"""
import json
import sys
import tempfile

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import semkv
from semkv.engine.kv_cache import SeqKV
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.methods import get_method

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
folder = tempfile.mkdtemp()
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                             tie_word_embeddings=False)).save_pretrained(folder)
tokenizer.save_pretrained(folder)
llm = semkv.LLM(folder, device=device, dtype="bfloat16" if device == "cuda" else "float32", prefill_chunk=128)
docs = [" ".join(f"Sentence {i} says that {i * 7} is {'odd' if i % 2 else 'even'}." for i in range(n))
        for n in (100, 110, 120)]
kw = dict(max_new_tokens=40, ignore_eos=True, chat=False)
page = llm.engine.pool.page_size
for name, params in (("sentencekv", {}), ("dynsplit", dict(offload_chunk=16))):
    logits, by_layer = {}, {}
    for offload in (True, False):
        method = get_method(name, 256, **params, offload=offload).bound(llm.config, llm.tokenizer, page)
        ids = llm.encode(docs[0], chat=False)[0]
        seq = Sequence(0, ids, SamplingParams(max_new_tokens=8), SeqKV(llm.engine.pool))
        seq.method_state, by_layer[offload] = method.new_state(seq), method.prefill_by_layer()
        try:
            logits[offload] = llm.engine.prefill(seq, method)
        finally:
            llm.engine.end([seq], method)
    tokens = {offload: [o.token_ids for o in llm.generate(docs, method=get_method(name, 256, **params,
                                                                                  offload=offload), **kw)]
              for offload in (True, False)}
    print(json.dumps(dict(method=name, prompt_tokens=len(ids), by_layer=by_layer,
                          logits_equal=torch.equal(logits[True], logits[False]),
                          same_tokens=tokens[True] == tokens[False], held=list(llm.engine.memory().held))),
          flush=True)
