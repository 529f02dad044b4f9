"""SentenceKV and DynSplit-KV offloaded (cache_factor 1 and 2) give the tokens of their resident runs on the device
with CUDA graphs: a tiny random Llama (4 layers, bf16) with the embedded model's tokenizer (`TOKENIZER`), a batch
of three documents of different lengths, 40 new tokens; nothing is held afterwards. Prints one JSON line per case.

    python same_tokens.py TOKENIZER [DEVICE]
"""
import json
import sys
import tempfile

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import semkv
from semkv.methods import get_method

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
folder = tempfile.mkdtemp()
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                             tie_word_embeddings=False)).save_pretrained(folder)
tokenizer.save_pretrained(folder)
llm = semkv.LLM(folder, device=device, dtype="bfloat16" if device == "cuda" else "float32")
docs = [" ".join(f"Sentence {i} says that {i * 7} is {'odd' if i % 2 else 'even'}." for i in range(n))
        for n in (260, 330, 400)]
kw = dict(max_new_tokens=40, ignore_eos=True, chat=False)
for name, params in (("sentencekv", {}), ("dynsplit", dict(offload_chunk=16))):
    resident = [o.token_ids for o in llm.generate(docs, method=get_method(name, 256, **params, offload=False), **kw)]
    for factor in (1.0, 2.0):
        out = llm.generate(docs, method=get_method(name, 256, **params, offload=True, cache_factor=factor), **kw)
        print(json.dumps(dict(method=name, cache_factor=factor, same=[o.token_ids for o in out] == resident,
                              h2d_bytes=[o.stats.h2d_bytes for o in out], held=list(llm.engine.memory().held))),
              flush=True)
