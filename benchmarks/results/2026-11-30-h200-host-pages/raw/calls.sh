# One H200 (session 32, 2026-11-30), from the repository root; four calls, each on a fresh machine, random
# weights of the Qwen2.5-0.5B shape (speed only), no vLLM installed (so prompt chunks attend through the Triton
# kernel, one call a chunk, not FlashAttention 3's packed call), .carry/data carried (RULER's essays, SmolLM2's
# tokenizer).
# The scripts: fu_now.sh (calls 1, 2), fu_call.sh (call 4; call 3 ran it with the cProfile run on CHESS instead of
# ChunkKV), fu_packed.sh (call 5), ../../2026-11-30-h200-evict-together/raw/fu_ab.sh (calls 3-5: both trees, each
# method in its own process, old first), copied into benchmarks/ for the calls.
# Trees: main's 11a8091 (call 1, and "old" in calls 3 and 4: .carry/old/semkv = `git archive 11a8091 semkv`); call 2:
# 11a8091 with the host page table in numpy only; call 3's "new": 1645540 less its last two changes (unshare asking
# the cache only past the protected pages, the Triton prefill's cached device queries); call 4's "new": 1645540.
# Call 5: "old" 567ea86 (= 1645540's semkv), "new" the next commit (a packed step's chunks in one Triton launch).
bash benchmarks/fu_now.sh                                                        # call 1: 11a8091, stagger 0 and 16
METHODS="chunkkv:neighbours=3 full" STAGGERS=0 EXTRA=--profile TAG=_prof bash benchmarks/fu_now.sh   # call 2
bash benchmarks/fu_call.sh                                                        # call 3
bash benchmarks/fu_call.sh                                                        # call 4
bash benchmarks/fu_packed.sh                                                      # call 5
