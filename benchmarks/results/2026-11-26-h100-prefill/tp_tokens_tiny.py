# Every method's tokens with 1 and 2 ranks on a tiny random float32 Llama saved as a HF folder at .gpu/tiny (the
# test suite's tiny model, copied there): prints "<method> True" where they are equal.
import sys, time, torch
from semkv.llm import LLM
if __name__ == "__main__":
    p = ["The quick brown fox jumps over the lazy dog. " * 40, "Hello world, this is a test of parallel. " * 30]
    out = {}
    for n in (1, 2):
        t = time.time()
        llm = LLM(".gpu/tiny", device="cuda", dtype="float32", tensor_parallel_size=n)
        print("load", n, round(time.time() - t, 1), flush=True)
        for m in ["full", "snapkv", "quest", "chess", "h2o", "infllm", "streaming_llm"]:
            t = time.time()
            r = llm.generate(p, method=m, budget=None if m == "full" else 64, max_new_tokens=24, chat=False)
            out[(n, m)] = [x.token_ids for x in r]
            print(n, m, round(time.time() - t, 2), flush=True)
        llm.close()
        del llm
        import gc; gc.collect(); torch.cuda.empty_cache()
    for m in ["full", "snapkv", "quest", "chess", "h2o", "infllm", "streaming_llm"]:
        print(m, out[(1, m)] == out[(2, m)])
