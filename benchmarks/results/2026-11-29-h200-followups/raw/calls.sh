# The device calls of this page as they ran (one NVIDIA H200 each; `run` calls from the repository root).
# Calls 1-33 of the first lease carried .carry/data, .carry/vllm's 16 parts and .carry/qwen's 16 parts
# (benchmarks/vllm_carry.sh), one part a call. Then:
# call 34: vLLM installed, the model converted; FlashAttention 3 at the model's shape; RULER NIAH with cuDNN's prefill
W=/tmp/w; bash benchmarks/vllm_device.sh setup
bash benchmarks/vllm_device.sh kernels 100 --attention-only                       # -> kernels_attention.txt
SEMKV_PREFILL_ATTENTION=cudnn bash benchmarks/vllm_device.sh ruler 300 --methods full --lengths 31744 \
  --budgets 0.1 --out $W/ruler_cudnn                                                # -> ruler_cudnn/
# call 35: the same RULER run with FlashAttention 3's prefill (auto: vLLM is installed)
SEMKV_PREFILL_ATTENTION=auto bash benchmarks/vllm_device.sh ruler 300 --methods full --lengths 31744 \
  --budgets 0.1 --out $W/ruler_fa3                                                  # -> ruler_fa3/
# call 36: vLLM then semkv Full KV, one after the other: one request at a time and the shared-document phases
bash benchmarks/vllm_device.sh serve 560 --servers vllm,full --phases c1,shared_first,shared_followup  # -> serve/
# call 37 (a fresh lease; .carry/data only): the follow-ups' steps of the tree at 9425d43, random weights
PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/followup_steps.py --shape qwen2.5-0.5b \
  --tokenizer .carry/data/smollm2-tokenizer --text-file /tmp/essays.txt --context 32000 --documents 8 \
  --questions 7 --new-tokens 128 --concurrency 8                                    # -> followup_call37_old.txt
# calls 38-62 (a third lease): .carry/data, gguf's wheel, .carry/qwen's 16 parts, the tree of 9425d43 as
# .oldtgz/old.tgz; call 63: call63/session2.sh (kernels, issue 55's modes at 16 rows, follow-ups old and new,
# SentenceKV's profile, whose table did not come back), call 64: the profile again -> call63/sentencekv_profile.md
# tables: python benchmarks/vllm_page.py --serve <the serve folder, gunzipped>
