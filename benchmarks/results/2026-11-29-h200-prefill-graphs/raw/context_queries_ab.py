"""cuDNN prefill attention before/after the context call lost its lead rows: same inputs, same process (0.5B and 8B head shapes)."""
import sys, json
import torch
from triton.testing import do_bench
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import importlib.util
spec = importlib.util.spec_from_file_location("oldcudnn", ".oldcudnn.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from semkv.kernels import cudnn_prefill as new, reference
gen = torch.Generator(device="cuda").manual_seed(0)
for heads, kvh, dim in ((14, 2, 64), (32, 8, 128)):
    page, n_max = 16, 32768 + 1024
    pages = n_max // page + 2
    k = torch.randn(pages, page, kvh, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(pages, page, kvh, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pages - 1, device="cuda", generator=gen) + 1
    for start, chunk in ((8500, 8176), (16401, 8176), (23000, 8176), (16384, 8176), (3000, 2000)):
        q = torch.randn(chunk, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        a = old.prefill_attention(q, k, v, table, start, dim**-0.5, lse=True)
        b = new.prefill_attention(q, k, v, table, start, dim**-0.5, lse=True)
        ref = reference.prefill_attention(q.float(), k.float(), v.float(), table, start, None, dim**-0.5, lse=True)
        err = lambda x, y: float((x.float() - y.float()).norm() / y.float().norm())
        ta = do_bench(lambda: old.prefill_attention(q, k, v, table, start, dim**-0.5, lse=True), return_mode="median")
        tb = do_bench(lambda: new.prefill_attention(q, k, v, table, start, dim**-0.5, lse=True), return_mode="median")
        print(json.dumps(dict(heads=heads, dim=dim, start=start, chunk=chunk, old_ms=round(ta, 3), new_ms=round(tb, 3),
                              ratio=round(ta / tb, 3), err_old=err(a[0], ref[0]), err_new=err(b[0], ref[0]),
                              err_lse_new=err(b[1], ref[1]), old_vs_new=err(b[0], a[0]))), flush=True)
import kernel_check
rows = kernel_check.check_prefill(gen)
for r in rows: print(json.dumps(r))
