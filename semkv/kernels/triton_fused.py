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


@triton.jit(do_not_specialize=["tokens"])
def _rope_store(Q, K, V, COS, SIN, ROWS, POS, QO, KF, VF, PF,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_rt, stride_rh,
                stride_ot, stride_oh, stride_fr, stride_fh, stride_pr, stride_pos, tokens,
                HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # this program's tokens
    h = tl.program_id(1)
    live = t < tokens
    t2, m2 = t[:, None], live[:, None]
    d = tl.arange(0, HALF)[None, :]
    c = tl.load(COS + t2 * stride_ct + d, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_T, HALF]
    s = tl.load(SIN + t2 * stride_ct + d, mask=m2, other=0.0).to(tl.float32)
    if h < HEADS:  # a query head: rotate into the output
        x1 = tl.load(Q + t2 * stride_qt + h * stride_qh + d, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(Q + t2 * stride_qt + h * stride_qh + HALF + d, mask=m2, other=0.0).to(tl.float32)
        base = QO + t2 * stride_ot + h * stride_oh
        tl.store(base + d, (x1 * c - x2 * s).to(QO.dtype.element_ty), mask=m2)
        tl.store(base + HALF + d, (x2 * c + x1 * s).to(QO.dtype.element_ty), mask=m2)
    else:  # a KV head: rotate the key, store key, value and position at the head's row of the pool
        kh = h - HEADS
        row = tl.load(ROWS + t * stride_rt + kh * stride_rh, mask=live, other=0).to(tl.int64)
        x1 = tl.load(K + t2 * stride_kt + kh * stride_kh + d, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(K + t2 * stride_kt + kh * stride_kh + HALF + d, mask=m2, other=0.0).to(tl.float32)
        kbase = KF + row[:, None] * stride_fr + kh * stride_fh
        tl.store(kbase + d, (x1 * c - x2 * s).to(KF.dtype.element_ty), mask=m2)
        tl.store(kbase + HALF + d, (x2 * c + x1 * s).to(KF.dtype.element_ty), mask=m2)
        vbase = VF + row[:, None] * stride_fr + kh * stride_fh
        tl.store(vbase + d, tl.load(V + t2 * stride_vt + kh * stride_vh + d, mask=m2), mask=m2)
        tl.store(vbase + HALF + d, tl.load(V + t2 * stride_vt + kh * stride_vh + HALF + d, mask=m2), mask=m2)
        tl.store(PF + row * stride_pr + kh, tl.load(POS + t * stride_pos, mask=live).to(tl.int32), mask=live)


def rope_store(q, k, v, cos, sin, rows, positions, kf, vf, pf):
    """Rotate q [T, heads, D] and k [T, kv_heads, D] by cos/sin [T, D] (RoPE tables: both halves equal, as
    `RotaryEmbedding.cos_sin` makes them); store k, v and positions [T] (any stride: a decode step passes a column
    of its packed inputs) at the pool rows [T, kv_heads] of kf/vf [rows, kv_heads, D] and pf [rows, kv_heads].
    Returns the rotated q. A program takes 16 tokens of one head (one token in a decode step's small batch)."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q)
    block = 16 if tokens >= 256 else 1
    _rope_store[(triton.cdiv(tokens, block), heads + kv_heads)](
        q, k, v, cos, sin, rows, positions, out, kf, vf, pf,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), rows.stride(0),
        rows.stride(1),
        out.stride(0), out.stride(1), kf.stride(0), kf.stride(1), pf.stride(0), positions.stride(0), tokens,
        HEADS=heads, HALF=dim // 2, BLOCK_T=block,
    )
    return out
