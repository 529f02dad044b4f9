# The six device calls of this page, in order, one H200 each (fresh machines: calls 1, 2, 4, 5, 6 started one; 3 ran
# on call 2's). Trees: main = 923bc9b; branch = next/first-tokens-first rebased on it (964ec91);
# warm-up = 923bc9b + Session.warm_up (call 4: the follow-ups all asking 3 tokens; call 5: 23700ab, the i-th
# follow-up asking 2 + i); call 6 = 2e52349 (23700ab + the window kernels' do_not_specialize). `.carry/old/semkv` held
# `git archive 923bc9b semkv` where a call names an old tree. Every followup_steps.py run: random weights of
# Qwen2.5-0.5B's shape, 8 documents of 32,000 tokens cut from the RULER essays, their first questions, then 56
# follow-ups of 40 tokens, 8 in flight, 64 new tokens each, steps of 8,192 tokens, prefix caching on; no vLLM
# installed (the packed forward runs semkv's Triton kernel, `_packed_prefill`).

# call 1 (carry .carry/data .carry/old): followup_steps old (main) / new (branch), follow-ups arriving one a step
EXTRA="--stagger 1" TAG=_s1 LIMIT=150 bash ../../2026-11-30-h200-first-token-first/raw/fu_ttft.sh  # copied to benchmarks/
# call 2 (carry .carry/data .carry/watch): main, each method in a fresh Triton cache, every compile logged; this
# compile_watch.py then printed the kernels' argument types (repr), run.sh had no cold/warm loop
bash run.sh            # METHODS: chunkkv:neighbours=3 chess:anchor=queries full
# call 3: the same for ChunkKV with compile_watch.py as here (each compile's specialization key)
METHODS=chunkkv:neighbours=3 bash run.sh
# call 4: the warm-up's first version; cold = without --warm-up, warm = with; each in its own fresh Triton cache
METHODS="chunkkv:neighbours=3 chess:anchor=queries" bash run.sh
# call 5: the warm-up as committed
METHODS=full bash run.sh; METHODS=chunkkv:neighbours=3 WARM=warm bash run.sh
# call 6: the window kernels without specializations (call6_window_kernels.txt: its kernel_check part)
bash run2.sh
