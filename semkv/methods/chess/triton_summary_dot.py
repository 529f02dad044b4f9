"""Summary dot-product kernel (CHESS's page scoring): dot products of per-page key summaries with one direction per
sequence and layer, summed over the layers, read in place from the summary table through page ids.

Same signature and result as `reference.summary_dots`. One program handles one sequence, a block of its pages and a
range of layers: for each layer it loads the block's physical page ids, then the summaries [block, kv_heads * D] in
slices, multiplies them with the layer's directions and accumulates [block, r] (r is 1 or 2: element-wise products
and a row sum, no matrix unit). The ranges of layers write partial sums that are added afterwards. The summaries are
read once, where gathering them first (the reference) writes and reads them twice more. The integers that change with
the batch and the page count (the width and the strides they set) are not specialised, so re-selecting any subset of
a batch compiles nothing new (specialised, the first re-selection of a subset of Qwen2.5-0.5B's 64 rows on an H200
stalled its decode step 0.45 s). Importing this module imports Triton; set TRITON_INTERPRET=1 before importing it to
run the kernel on CPU tensors (slowly) for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["W", "stride_pb", "stride_pl", "stride_os", "stride_ob"])
def _summary_dot_kernel(sums_ptr, pages_ptr, dirs_ptr, out_ptr, W, LAYERS, LAYERS_PER,
                        stride_pb, stride_pl, stride_db, stride_dr, stride_dl, stride_os, stride_ob, stride_ow,
                        HD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_W: tl.constexpr,
                        BLOCK_HD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    split = tl.program_id(2)
    valid = j < W
    r = tl.arange(0, R_PAD)
    acc = tl.zeros([BLOCK_W, R_PAD], tl.float32)
    first = split * LAYERS_PER
    for layer in range(first, tl.minimum(first + LAYERS_PER, LAYERS)):
        ids = tl.load(pages_ptr + b * stride_pb + layer * stride_pl + j, mask=valid, other=0).to(tl.int64)
        for h0 in tl.static_range(0, HD, BLOCK_HD):
            e = h0 + tl.arange(0, BLOCK_HD)
            s = tl.load(sums_ptr + ids[:, None] * HD + e[None, :], mask=valid[:, None] & (e < HD)[None, :],
                        other=0.0)  # [BLOCK_W, BLOCK_HD]
            d = tl.load(dirs_ptr + b * stride_db + r[None, :] * stride_dr + layer * stride_dl + e[:, None],
                        mask=(r < R)[None, :] & (e < HD)[:, None], other=0.0)  # [BLOCK_HD, R_PAD]
            acc += tl.sum(s[:, :, None] * d[None, :, :], 1)
    tl.store(out_ptr + split * stride_os + b * stride_ob + j[:, None] * stride_ow + r[None, :], acc,
             mask=valid[:, None] & (r < R)[None, :])


def summary_dots(sums: torch.Tensor, pages: torch.Tensor, directions: torch.Tensor, block_w: int = 16,
                 block_hd: int = 256, layers_per: int = 4, num_warps: int = 4) -> torch.Tensor:
    """sums [pool_pages, kv_heads, D] float32 (contiguous); pages [B, layers, w] physical ids; directions [B, r,
    layers, kv_heads, D]. Returns float32 [B, w, r]. `layers_per`: layers one program adds up. The defaults were
    the fastest of a sweep on an H200 (25 sequences x 2050 pages x 32 layers, 8 x 128 floats a summary: 1.83 ms,
    the bytes take 1.60 ms at the measured bandwidth)."""
    batch, layers, w = pages.shape
    r = directions.shape[1]
    hd = sums.shape[1] * sums.shape[2]
    splits = triton.cdiv(layers, layers_per)
    out = torch.empty(splits, batch, w, r, dtype=torch.float32, device=sums.device)
    if w == 0:
        return out.sum(0)
    dirs = directions.float().reshape(batch, r, layers, hd).contiguous()
    pages = pages.contiguous()
    _summary_dot_kernel[(batch, triton.cdiv(w, block_w), splits)](
        sums.contiguous(), pages, dirs, out, w, layers, layers_per,
        pages.stride(0), pages.stride(1), dirs.stride(0), dirs.stride(1), dirs.stride(2), out.stride(0),
        out.stride(1), out.stride(2), HD=hd, R=r, R_PAD=triton.next_power_of_2(r), BLOCK_W=block_w,
        BLOCK_HD=min(block_hd, triton.next_power_of_2(hd)), num_warps=num_warps,
    )
    return out.sum(0)
