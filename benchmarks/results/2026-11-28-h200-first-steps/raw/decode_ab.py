import importlib.util, re, sys, tempfile, torch, triton
from pathlib import Path
def load(name, path, text=None):
    if text is not None:
        p = Path(tempfile.mkdtemp()) / f"{name}.py"; p.write_text(text); path = p
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
new_src = Path("semkv/kernels/triton_decode.py").read_text()
nodns = re.sub(r'@triton.jit\(do_not_specialize=\["stride_tb".*?\]\)\ndef _partial', '@triton.jit\ndef _partial', new_src, flags=re.S)
assert nodns != new_src
mods = {"old": load("old_td", ".old/semkv/kernels/triton_decode.py"), "new": load("new_td", "semkv/kernels/triton_decode.py"),
        "new_partial_specialized": load("nodns_td", None, nodns)}
torch.manual_seed(0)
H, HK, D, PAGE = 14, 2, 64, 16
for B, ctx in [(1, 32768), (8, 8192), (16, 32768), (16, 8192), (64, 32768)]:
    pages = B * ctx // PAGE + 8
    k = torch.randn(pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(pages - 1, device="cuda")[: B * ctx // PAGE].view(B, -1) + 1
    lengths = torch.full((B, 1), ctx, device="cuda", dtype=torch.long)
    outs, res = {}, {n: [] for n in mods}
    for rep in range(3):
        for n, m in mods.items():
            f = lambda: m.decode_attention(q, k, v, tables, None, lengths, D ** -0.5, max_len=ctx)
            outs[n] = f(); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    f()
            res[n].append(triton.testing.do_bench(g.replay, warmup=20, rep=200) / 20)
    ref = outs["old"].float()
    print(f"B={B} ctx={ctx}: " + "  ".join(f"{n} {min(r)*1e3:.1f}us (max err {float((outs[n].float()-ref).abs().max()):.1e})" for n, r in res.items()), flush=True)
