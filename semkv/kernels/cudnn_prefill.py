"""Full prefill attention (a chunk over every earlier slot and itself) through cuDNN's fused attention, the kernel
library NVIDIA tunes for Hopper, reached through torch: on an H100 it runs a causal 8k chunk at about 610 TFLOP/s
where FlashAttention-2 (torch's flash backend) and the paged Triton kernel run at about 350
(`benchmarks/prefill_sweep.py`).

cuDNN reads contiguous K/V, so the sequence's slots [0, start + C) are gathered out of the pages first (one copy of
their K/V, about 1% of the attention's time at 32k). The chunk then attends in two unmasked-or-square calls that cuDNN
runs at full speed (a lower-right causal mask over a rectangle is not one of them): the context [0, start) without a
mask, and the chunk's own slots with the square causal mask. The two partial outputs merge by their log-sum-exps.
Sparse prefill (an index list) and short chunks (few query blocks: the Triton kernel splits the context instead)
stay on `triton_prefill`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from semkv.kernels.optional_path import OptionalPath

MIN_CHUNK = 1024  # shorter chunks: the Triton kernel, whose context splits fill the device
PAD = 1024  # chunk lengths are padded to a multiple of this (fewer cuDNN plans)


PATH = OptionalPath("cuDNN prefill attention", "the Triton kernel serves prefill instead")


def usable(q: torch.Tensor, context: torch.Tensor | None) -> bool:
    """True when this path serves the call: full attention, a long chunk, 16-bit values, head_dim <= 128, a Hopper
    (or later) GPU whose torch build has cuDNN, and no earlier call of the path failed (`PATH`)."""
    return (not PATH.failed and context is None and q.shape[0] >= MIN_CHUNK
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 128
            and torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(q.device)[0] >= 9)


def attend(q, k_pool, v_pool, table, start, scale, lse=False):
    """`prefill_attention`, or None where cuDNN refuses the call (an old cuDNN, a torch build without its attention):
    the path is then turned off for the process (`PATH`)."""
    return PATH.run(prefill_attention, q, k_pool, v_pool, table, start, scale, lse)


def _attend(q, k, v, causal: bool, scale: float, lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [1, heads, C, D], k/v [1, kv_heads, n, D] -> out [1, heads, C, D], natural-log lse [1, heads, C] float32
    (None with lse=False: cuDNN then runs a faster plan, about 8% on a causal 16k chunk on an H100)."""
    out, total = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal, False,
                                                                    scale=scale)[:2]
    return out, total.view(q.shape[:3]) if lse else None


@triton.jit(do_not_specialize=["chunk"])  # a step budget cuts chunks of any length: one compile for all
def _merge(OA, LA, OB, LB, OUT, LSE, stride_ah, stride_am, stride_bh, stride_bm, stride_la, stride_lb, chunk,
           HEADS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """One head's block of queries: the attention over two disjoint key sets from each one's output and
    log-sum-exp (each set weighted by its share of the softmax mass), written as [C, heads, D] (the layout the model
    reads), and the lse of the union."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    valid = rows < chunk
    la = tl.load(LA + h * stride_la + rows, mask=valid, other=0.0)
    lb = tl.load(LB + h * stride_lb + rows, mask=valid, other=0.0)
    top = tl.maximum(la, lb)
    wa, wb = tl.exp(la - top), tl.exp(lb - top)
    total = wa + wb
    oa = tl.load(OA + h * stride_ah + rows[:, None] * stride_am + d[None, :], mask=valid[:, None], other=0.0)
    ob = tl.load(OB + h * stride_bh + rows[:, None] * stride_bm + d[None, :], mask=valid[:, None], other=0.0)
    out = (oa.to(tl.float32) * (wa / total)[:, None] + ob.to(tl.float32) * (wb / total)[:, None])
    tl.store(OUT + rows[:, None] * (HEADS * D) + h * D + d[None, :], out.to(OUT.dtype.element_ty),
             mask=valid[:, None])
    tl.store(LSE + rows * HEADS + h, top + tl.log(total), mask=valid)


def merged(out_a, lse_a, out_b, lse_b, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_merge` of [1, heads, C', D] outputs and [1, heads, C'] lses (views of any strides but the last), cut to the
    first `chunk` queries: out [C, heads, D], lse [C, heads] float32."""
    _, heads, _, dim = out_a.shape
    out = torch.empty(chunk, heads, dim, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(chunk, heads, dtype=torch.float32, device=out_a.device)
    block = 64
    _merge[(triton.cdiv(chunk, block), heads)](
        out_a, lse_a, out_b, lse_b, out, lse, out_a.stride(1), out_a.stride(2), out_b.stride(1), out_b.stride(2),
        lse_a.stride(1), lse_b.stride(1), chunk, HEADS=heads, D=dim, BLOCK=block)
    return out, lse


def prefill_attention(q, k_pool, v_pool, table, start, scale, lse=False):
    """`reference.prefill_attention` with context None: q [C, heads, D] of slots [start, start + C) over every slot
    below start + C. Returns out [C, heads, D] (and the natural-log lse [C, heads] float32 with lse=True).

    cuDNN builds an execution plan for each new shape (about 50 ms on an H100), so every call's lengths are multiples
    of `PAD`: the context call reads slots [0, base), base = start rounded down to a multiple of PAD, with the chunk's
    queries padded to a multiple of PAD; the causal call reads [base, start + C) with zero queries before the chunk's
    (`lead` = start - base of them) and after it (to a multiple of PAD; the causal mask keeps the real queries off the
    padded keys), and only the chunk's rows are kept.
    A chunk of any length at any start, as a server's step budget cuts them, then reuses one of a few plans per
    context length (`warm_up` builds the full chunks' ones, `warm_up_cuts` a server's). torch keys a plan by the
    tensors' shapes and strides, so the chunk's queries and keys always go to cuDNN as contiguous copies (one layout,
    one plan a shape)."""
    chunk, heads, dim = q.shape
    n = start + chunk
    _, page, kv_heads, _ = k_pool.shape
    base = start - start % PAD
    lead = start - base
    pad = -(lead + chunk) % PAD
    pages = table[: -(-n // page)]
    k, v = (x[pages].view(-1, kv_heads, dim)[:n].transpose(0, 1)[None] for x in (k_pool, v_pool))  # [1, KH, n, D]
    qt, own_k, own_v = q.transpose(0, 1)[None], k[:, :, base:], v[:, :, base:]  # [1, heads or KH, lead + C, D]
    if lead or pad:
        qt = F.pad(qt, (0, 0, lead, pad))  # [1, heads, lead + C + pad, D] contiguous
        own_k, own_v = (F.pad(x, (0, 0, 0, pad)) for x in (own_k, own_v))
    else:
        qt, own_k, own_v = qt.contiguous(), own_k.contiguous(), own_v.contiguous()
    out, total = _attend(qt, own_k, own_v, True, scale, lse=lse or base > 0)
    if base:
        # the context call takes the chunk's queries alone, padded to a multiple of PAD: not the `lead` rows before
        # them, which would make it up to PAD rows longer (11% of an 8,192-token chunk's largest call)
        cq = qt if not lead else F.pad(q.transpose(0, 1)[None], (0, 0, 0, -chunk % PAD))  # [1, heads, C', D]
        cq = cq.contiguous()
        context, context_lse = _attend(cq, k[:, :, :base], v[:, :, :base], False, scale)
        out, total = merged(context, context_lse, out[:, :, lead:], total[:, :, lead:], chunk)
    else:  # the chunk's keys begin at slot 0: one call, no merge
        out = out[0, :, lead:lead + chunk].transpose(0, 1)
        total = None if total is None else total[0, :, lead:lead + chunk].transpose(0, 1)
    return (out, total) if lse else out


def warm_up(k_pool, v_pool, heads: int, scale: float, chunk: int, max_len: int) -> None:
    """Build the plans of full chunks of `chunk` tokens at every start below max_len (reading the pool's scratch
    page), so that the first long prompt pays no plan building; a shorter last chunk builds its own on first use."""
    dtype, device, dim = k_pool.dtype, k_pool.device, k_pool.shape[-1]
    table = torch.zeros(-(-max_len // k_pool.shape[1]) + 1, dtype=torch.int32, device=device)
    q = torch.zeros(chunk, heads, dim, dtype=dtype, device=device)
    if not usable(q, None):
        return
    for start in range(0, max(max_len - chunk, 0) + 1, chunk):
        for lse in (True, False) if start == 0 else (True,):  # a first chunk asked for no lse runs its own plan
            if attend(q, k_pool, v_pool, table, start, scale, lse=lse) is None:
                return


def warm_up_cuts(k_pool, v_pool, heads: int, scale: float, step: int, chunk: int, max_len: int) -> None:
    """Build the plans of every call a server's cuts make (steps of at most `step` prompt tokens, or of the engine's
    `chunk` when nothing decodes, at any start below max_len): the causal call at every padded length up to the
    longer of the two (with and without the lse), and the context call at every padded chunk length up to `step`'s
    against every context length that is a multiple of PAD. A server otherwise builds them (about 50 ms each) while
    requests wait: the likely cause of the half rate at which an H200 server prefilled 64 prompts of 32k (results
    page 2026-11-28-h200x2-servers). The calls read zeros, shaped and strided as `prefill_attention`'s."""
    dtype, device, dim = k_pool.dtype, k_pool.device, k_pool.shape[-1]
    kv_heads = k_pool.shape[2]
    if not usable(torch.zeros(MIN_CHUNK, heads, dim, dtype=dtype, device=device), None):
        return
    padded = lambda tokens: -(-(tokens + PAD - 1) // PAD) * PAD  # noqa: E731  the longest padded call of a cut
    context = torch.zeros(max_len, kv_heads, dim, dtype=dtype, device=device).transpose(0, 1)[None]  # [1, KH, n, D]
    try:
        for length in range(PAD, min(padded(max(step, chunk)), padded(max_len)) + 1, PAD):
            q = torch.zeros(1, heads, length, dim, dtype=dtype, device=device)
            own = torch.zeros(1, kv_heads, length, dim, dtype=dtype, device=device)
            for lse in (True, False):
                _attend(q, own, own, True, scale, lse=lse)
            if length <= padded(step):
                for base in range(PAD, max_len - MIN_CHUNK + 1, PAD):
                    _attend(q, context[:, :, :base], context[:, :, :base], False, scale)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        PATH.turn_off(exc)
