"""SentenceKV on the 8k RULER NIAH samples where Full KV answered and SentenceKV retain="sentences", score="tokens"
did not on the H100 (2026-11-26-h100-niah/eval_qwen_8k_16k): does the current token's query (query="current") or
keeping only the budget at prefill (keep_factor=1) recover them? CPU, float32, Qwen2.5-Coder-0.5B-Instruct GGUF. Run from the repository root:
    python probe.py MODEL.gguf DATA_DIR OUT.jsonl      (DATA_DIR holds paul_graham/, as for `semkv eval`)"""
import json, sys, time
import semkv
from semkv.eval.runner import make_arms, make_task

GPU = "benchmarks/results/2026-11-26-h100-niah/eval_qwen_8k_16k/predictions.jsonl"
PICK = {"ruler_niah_multikey_2": [15, 16, 19], "ruler_niah_multivalue": [3, 4, 5, 6, 17, 18],
        "ruler_niah_multikey_3": [3, 5, 8, 10]}
ARMS = ["sentencekv[retain=sentences,score=tokens]", "sentencekv[retain=sentences,score=tokens,query=current]",
        "sentencekv[retain=sentences,score=tokens,keep_factor=1]"]
model, data, out = sys.argv[1], sys.argv[2], sys.argv[3]
gpu = {(r["sample_id"], r["method"]): r["score"] for r in map(json.loads, open(GPU))
       if r["length"] == 8192 and r["budget"] in (None, 0.1)}
llm = semkv.LLM(model, device="cpu")
arms = make_arms(ARMS, [0.1], {}, None)
with open(out, "a") as f:
    for name, ids in PICK.items():
        task = make_task(name, data, 64)
        drawn = list(task.samples(llm.tokenizer, 8192, 20, 0))
        samples = [drawn[i] for i in ids]
        for arm in arms:
            t = time.time()
            outs = llm.generate([s.context for s in samples], arm.build(), max_new_tokens=task.max_new_tokens,
                                chat=task.chat, questions=[s.question for s in samples],
                                answer_prefixes=[s.answer_prefix for s in samples])
            for s, o in zip(samples, outs):
                row = {"task": name, "sample_id": s.sample_id, "method": arm.method, "score": task.score(o.text, s),
                       "prediction": o.text, "gpu_full": gpu[(s.sample_id, "full")],
                       "gpu_method": gpu.get((s.sample_id, arm.method))}
                f.write(json.dumps(row) + "\n"); f.flush()
            print(name, arm.label, [round(task.score(o.text, s)) for s, o in zip(samples, outs)],
                  f"{time.time() - t:.0f}s", flush=True)
