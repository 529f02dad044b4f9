# One H200 (session 31, 2026-11-30), from the repository root; three leases. Tree: main's 8bfdc2c plus this page's
# change (before its last fix, which orders `SeqKV.unshare`'s allocation before any page leaves for a failed
# allocation's sake: the same work). .carry/old/semkv held `git archive 8bfdc2c semkv` (main's head).
# lease 1, call 1 (random weights of the Qwen2.5-0.5B shape, tree 8bfdc2c + followup_steps.py's --param and
# eviction timers): cProfile of the staggered follow-ups (raw/profile/)
export PYTHONPATH=$PWD:$PWD/benchmarks
for m in "chunkkv neighbours=3" "chess anchor=queries"; do set -- $m
  python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b --tokenizer .carry/data/smollm2-tokenizer \
    --text-file /tmp/essays.txt --method $1 --param $2 --documents 8 --questions 7 --concurrency 8 \
    --new-tokens 128 --stagger 16 --profile > $OUT/$1.txt
done
# lease 2, call 3 (raw/ab1/: the change's first version, before numpy bookkeeping in unshare and the prefix
# cache's release; fu_ab.sh's first version looped "$@" over the trees and ran ChunkKV and CHESS):
bash benchmarks/fu_ab.sh old new
# lease 2, call 4 (raw/ab2/: the change as served; fu_ab.sh as kept here):
TREES="old new" METHODS="full chunkkv:neighbours=3 chess:anchor=queries" bash raw/fu_ab.sh
# lease 3: carrying as on the 2026-11-30-h200-followup-admission page (call 1 data and SHA256SUMS, then one part a
# call), then the served shared-document phases (real weights, vLLM 0.26.0's `vllm bench serve` as the client):
bash benchmarks/vllm_device.sh setup   # wheels installed in 15 s, GGUF converted in 96 s, ready in 112 s
bash benchmarks/vllm_device.sh serve 330 --servers "chunkkv[neighbours=3]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 250 --servers "chess[anchor=queries]" --phases shared_first,shared_followup
bash benchmarks/vllm_device.sh serve 185 --servers full --phases shared_first,shared_followup
# here: each client JSON gzipped with its times rounded to the microsecond, logs and /metrics gzipped; the tables:
python benchmarks/vllm_page.py --serve benchmarks/results/2026-11-30-h200-evict-together/raw/serve
