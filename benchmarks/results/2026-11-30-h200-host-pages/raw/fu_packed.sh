# one call: the packed Triton prefill on the device (its rows against a call a chunk), then old (HEAD, .carry/old)
# and new followup_steps for Full KV and ChunkKV
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD python3 - <<'PY'
import torch
from semkv.kernels.triton_prefill import packed_prefill_attention, prefill_attention
torch.manual_seed(0)
dev, size = torch.device("cuda"), 16
k = torch.randn(20000, size, 2, 64, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
spans = [(31000, 40), (12000, 300), (0, 700), (32000, 1)]
tables = torch.stack([torch.randperm(20000, device=dev)[:2100] for _ in spans]).to(torch.int32)
lens = [c for _, c in spans]
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
used = torch.tensor([a + c for a, c in spans], dtype=torch.int32, device=dev)
q = torch.randn(sum(lens), 14, 64, device=dev, dtype=torch.bfloat16)
got = packed_prefill_attention(q, k, v, tables, cu, used, max(lens), max(a + c for a, c in spans), 0.125)
want = torch.cat([prefill_attention(q[lo:hi], k, v, t.long(), a, None, 0.125)
                  for (a, c), t, lo, hi in zip(spans, tables, cu[:-1].tolist(), cu[1:].tolist())])
print("packed vs a call a chunk: max |diff|", (got.float() - want.float()).abs().max().item())
PY
TREES="old new" METHODS="full chunkkv:neighbours=3" bash benchmarks/fu_ab.sh
