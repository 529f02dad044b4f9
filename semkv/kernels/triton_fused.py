"""Small fused Triton kernels for the decoder's elementwise work on CUDA (fewer launches per layer in a decode step):
residual add + RMSNorm, and SiLU(gate) * up. The torch references are `reference.rms_norm` / `reference.silu_mul`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(X, R, W, Y, RO, stride_x, stride_r, stride_y, stride_ro, n, eps,
              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(RO + row * stride_ro + cols, x.to(RO.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, 0) / n
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = (x * tl.rsqrt(var + eps)).to(Y.dtype.element_ty)  # cast before the weight, as the reference does
    tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, n] (+ residual [T, n]) -> (RMSNorm(x + residual), x + residual)."""
    rows, n = x.shape
    y = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    _rms_norm[(rows,)](x, r, weight, y, summed, x.stride(0), r.stride(0), y.stride(0), summed.stride(0), n, eps,
                       HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return y, summed


@triton.jit
def _silu_mul(GU, O, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty).to(tl.float32)
    tl.store(O + row * stride_o + cols, (silu * u).to(O.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2n] (gate then up) -> SiLU(gate) * up [T, n]."""
    rows, double = gate_up.shape
    n = double // 2
    out = torch.empty(rows, n, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out
