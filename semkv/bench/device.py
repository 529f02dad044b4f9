"""What a benchmark run records about its machine: device, driver, versions, and the measured memory bandwidth."""
from __future__ import annotations

import platform
import subprocess

import torch


def measured_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Device-memory bandwidth in bytes/s from a large device-to-device copy (bytes read + written)."""
    if device.type != "cuda":
        return 0.0
    n = int(gib * 2**30) // 2
    src = torch.randn(n // 2, device=device, dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]


def measured_gemm_tflops(device: torch.device, m: int = 8192, k: int = 4096, n: int = 14336,
                         repeats: int = 20) -> float:
    """bf16 matrix-multiply TFLOP/s of the card (a Llama-8B MLP-shaped GEMM through cuBLAS): the rate the prefill
    FLOP floor divides by. 20 repeats (about 50 ms on an H100) give its rate from cool; about 1000 (2.5 s) the rate
    it holds through a long prefill, about 12% lower on an H100 (its clocks come down under sustained load)."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * m * k * n * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def device_info(device: torch.device) -> dict:
    info = dict(device=str(device), torch=torch.__version__, python=platform.python_version(),
                cpu=platform.processor() or platform.machine())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
        info["hbm_bandwidth_gbs"] = round(measured_bandwidth(device) / 1e9, 1)
        info["gemm_tflops"] = round(measured_gemm_tflops(device), 1)
    else:
        info.update(name=platform.processor() or "cpu", threads=torch.get_num_threads())
    return info
