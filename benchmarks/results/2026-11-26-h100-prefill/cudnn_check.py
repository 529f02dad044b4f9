import json, time, torch
from semkv.kernels import cudnn_prefill, triton_prefill, reference
from triton.testing import do_bench
torch.manual_seed(0)
D = 128
def paged(n, kvh, page=16):
    pages = -(-n // page)
    k = torch.randn(pages, page, kvh, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pages, page, kvh, D, device="cuda", dtype=torch.bfloat16)
    return k, v, torch.randperm(pages, device="cuda", dtype=torch.int32)
for heads, kvh, start, chunk in [(32, 8, 0, 1024), (32, 8, 3000, 1500), (28, 4, 5000, 2048), (8, 8, 777, 1100)]:
    k, v, t = paged(start + chunk, kvh)
    q = torch.randn(chunk, heads, D, device="cuda", dtype=torch.bfloat16)
    try:
        got, lse = cudnn_prefill.prefill_attention(q, k, v, t, start, D**-0.5, lse=True)
        want, wlse = reference.prefill_attention(q.float(), k.float(), v.float(), t, start, None, D**-0.5, lse=True)
        tr, tlse = triton_prefill.prefill_attention(q, k, v, t, start, None, D**-0.5, lse=True)
        print(json.dumps(dict(heads=heads, kvh=kvh, start=start, chunk=chunk, err=float((got.float()-want).abs().max()),
              lse_err=float((lse-wlse).abs().max()), triton_err=float((tr.float()-want).abs().max()), triton_lse_err=float((tlse-wlse).abs().max()))), flush=True)
    except Exception as exc:
        print("ERR", heads, kvh, start, chunk, repr(exc)[:300], flush=True)
for start, chunk in [(0, 8192), (24576, 8192), (122880, 8192), (31744, 1024), (0, 16384), (16384, 16384)]:
    k, v, t = paged(start + chunk, 8)
    q = torch.randn(chunk, 32, D, device="cuda", dtype=torch.bfloat16)
    flops = 4 * 32 * D * chunk * (start + (chunk + 1) / 2)
    res = dict(start=start, chunk=chunk)
    for name, fn in [("cudnn", lambda: cudnn_prefill.prefill_attention(q, k, v, t, start, D**-0.5)),
                     ("cudnn_lse", lambda: cudnn_prefill.prefill_attention(q, k, v, t, start, D**-0.5, lse=True)),
                     ("triton", lambda: triton_prefill.prefill_attention(q, k, v, t, start, None, D**-0.5, tile=(128, 64, 4, 3))),
                     ("triton32", lambda: triton_prefill.prefill_attention(q, k, v, t, start, None, D**-0.5, tile=(128, 32, 4, 3)))]:
        try:
            ms = do_bench(fn, warmup=5, rep=40, return_mode="median")
            res[name] = [round(ms, 3), round(flops / ms / 1e9)]
        except Exception as exc:
            res[name] = repr(exc)[:200]
    print(json.dumps(res), flush=True)
    del k, v
# a fresh shape's first call against its second
k, v, t = paged(40000, 8)
for start, chunk in [(7777, 1500), (9999, 3001), (20000, 8192)]:
    q = torch.randn(chunk, 32, D, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(3):
        torch.cuda.synchronize(); s = time.perf_counter()
        cudnn_prefill.prefill_attention(q, k, v, t, start, D**-0.5)
        torch.cuda.synchronize(); times.append(round(1e3 * (time.perf_counter() - s), 2))
    print(json.dumps(dict(fresh_shape=[start, chunk], ms=times)), flush=True)
