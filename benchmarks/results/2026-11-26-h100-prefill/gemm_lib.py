import torch, json
from triton.testing import do_bench
shapes = [(8192, 4096, 6144), (8192, 4096, 4096), (8192, 4096, 28672), (8192, 14336, 4096)]
for lib in ["default", "cublaslt", "cublas"]:
    if lib != "default":
        torch.backends.cuda.preferred_blas_library(lib)
    row = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: torch.nn.functional.linear(a, w), return_mode="median")
        row[f"{m}x{k}x{n}"] = round(2 * m * k * n / ms / 1e9)
    print(lib, json.dumps(row), flush=True)
