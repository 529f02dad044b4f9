"""Triton decode attention over the paged cache (flash-decoding): one query per sequence attends to the slots of an
index list (token granularity), or to every stored slot, reading K/V straight from the pool through the page table.

Same contract as `reference.decode_attention`. A program handles one (sequence, KV head, split of the attended list)
and all query heads of the KV group at once, so each K/V row is read once per group (GQA); partial results of the
splits are merged by a second small kernel with their log-sum-exp. Page-granular selections (Quest, CHESS) are
expanded to slot lists by `Selection`, so whole pages stay contiguous reads.

Launch settings (`launch_settings`, `num_splits_for`) come from `benchmarks/decode_kernel_sweep.py` on an H200 with
the Llama-3.1-8B and Qwen2.5-0.5B shapes at 32k: scattered token rows (index lists) run best on two warps with a
four-stage pipeline over 64-row blocks (TokenSelect's 2688 tokens: 1.68x -> 1.15x the byte floor at Llama's shape,
25 x 32k); every stored slot (whole pages) on four warps with three stages over 128-row blocks, in splits of at most
4096 slots (Full KV at 25 x 32k: 794 -> 749 us a layer; at Qwen's 64 x 32k 1.25x -> 1.0x the floor). The launch's
bound sets the number of splits; each row divides its own length among them. (With splits cut from the bound, an
evicting method's rows, about 3,200 slots in a CUDA graph sized for a 31,744-token prompt, all fell in the first
of 9 splits of 3,584: ChunkKV's attention took 50 us a layer at 16 rows on an H200 where CHESS's, over as many
slots, took 14 us.)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# splits of one row's slots at most; `_combine` is compiled for 16 splits or for this many (two variants, both built by
# the engine's warm-up: a small batch of a short context takes this many, 16 rows of a long one fewer than 16)
MAX_SPLITS = 128


# integer arguments that vary with a batch's size, its longest request and its splits: Triton would compile the kernel
# again for each new divisibility of them (a server's first steps waited seconds for it); the K/V strides stay
# specialized (they are fixed by the pool)
@triton.jit(do_not_specialize=["stride_tb", "stride_sb", "stride_ss", "stride_lb", "stride_ls", "stride_eb",
                               "stride_eh"])
def _partial(
    Q, K, V, Tables, Slots, Lengths, Out, Lse,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_tb, stride_sb, stride_ss, stride_lb, stride_ls,
    stride_ob, stride_oh, stride_os, stride_eb, stride_eh,
    scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_SLOTS: tl.constexpr, PER_HEAD: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    sel = kvh if PER_HEAD else 0
    length = tl.load(Lengths + b * stride_lb + sel * stride_ls)
    # the row's own length in equal splits of whole blocks: a row far below the launch's bound (what an evicting
    # method keeps, in a CUDA graph sized for its prompt) still spreads over every split, not all in the first
    split_len = tl.cdiv(tl.cdiv(length, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    q_mask = g < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask[:, None], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        valid = j < end
        if HAS_SLOTS:
            slot = tl.load(Slots + b * stride_sb + sel * stride_ss + j, mask=valid, other=0)
        else:
            slot = j
        page = tl.load(Tables + b * stride_tb + slot // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * PAGE + slot % PAGE
        k = tl.load(K + row[:, None] * stride_kr + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + row[:, None] * stride_kr + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new

    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=q_mask[:, None])
    tl.store(Lse + b * stride_eb + heads * stride_eh + split, lse, mask=q_mask)


@triton.jit(do_not_specialize=["stride_ob", "stride_eb", "stride_eh", "splits"])
def _combine(Out, Lse, O, LseOut, stride_ob, stride_oh, stride_os, stride_eb, stride_eh, stride_es, stride_fb,
             stride_fh, splits, SPLITS_PAD: tl.constexpr, D: tl.constexpr, LOG2: tl.constexpr, WRITE_LSE: tl.constexpr):
    """One row b (a decode row, or a prefill chunk's query) and head h: the parts' outputs Out [.., splits, D]
    weighted by their shares of the softmax mass (log-sum-exps Lse, natural or with LOG2 base-2 units) into O; with
    WRITE_LSE the merged natural log-sum-exp into LseOut [rows, heads] (contiguous). Shared by the decode and prefill
    kernels."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    mask = s < splits
    lse = tl.load(Lse + b * stride_eb + h * stride_eh + s * stride_es, mask=mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if LOG2:
        w = tl.where(mask, tl.exp2(lse - m), 0.0)
    else:
        w = tl.where(mask, tl.exp(lse - m), 0.0)
    part = tl.load(Out + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :], mask=mask[:, None],
                   other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / total
    tl.store(O + b * stride_fb + h * stride_fh + d, o.to(O.dtype.element_ty))
    if WRITE_LSE:
        if LOG2:
            merged = (m + tl.log2(total)) * 0.6931471805599453  # natural
        else:
            merged = m + tl.log(total)
        tl.store(LseOut + b * tl.num_programs(1) + h, merged)


@functools.cache
def device_limits(index: int) -> tuple[int, int]:
    """(multiprocessors, shared memory bytes one program may use) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def launch_settings(dim: int, element_size: int, gathered: bool, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of `_partial` for index lists (gathered) or every stored slot, with the
    pipeline cut to the stages whose K and V tiles fit the device's shared memory."""
    block_n, warps, stages = (64, 2, 4) if gathered else (128, 4, 3)
    if device.type == "cuda":
        per_stage = 2 * block_n * dim * element_size
        stages = max(1, min(stages, device_limits(device.index or 0)[1] // per_stage))
    return block_n, warps, stages


def splits_pad(splits: int) -> int:
    """`_combine`'s SPLITS_PAD for `splits` (a compile-time size: two values unless a caller asks for more splits
    than `MAX_SPLITS`)."""
    return 16 if splits <= 16 else max(MAX_SPLITS, triton.next_power_of_2(splits))


def num_splits_for(max_len: int, batch_heads: int, sm_count: int = 132, block_n: int = 64,
                   longest_split: int = 4096) -> int:
    """Enough splits to give every SM two programs and keep every split within `longest_split` slots (large batches
    end in a short tail of programs), none shorter than two blocks."""
    by_work = max(1, -(-max_len // (2 * block_n)))
    by_sms = max(1, -(-2 * sm_count // max(batch_heads, 1)))
    return min(by_work, max(by_sms, -(-max_len // longest_split)), MAX_SPLITS)


def decode_attention(q, k_pool, v_pool, tables, slots, lengths, scale, num_splits=None, block_n=None, max_len=0):
    """q [B, heads, D]; k_pool/v_pool [pages, page_size, kv_heads, D]; tables [B, max_pages]; slots [B, S, n] or None
    (all stored slots); lengths [B, S]; max_len: upper bound of lengths when slots is None (0: read it from the
    device, which a CUDA graph cannot do), which sets the number of splits; num_splits, block_n: override
    `launch_settings` / `num_splits_for`.
    Returns [B, heads, D] in q's dtype."""
    batch, n_heads, dim = q.shape
    _, page, kv_heads, _ = k_pool.shape
    group = n_heads // kv_heads
    if slots is not None:
        max_len = slots.shape[-1]
    elif not max_len:
        max_len = int(lengths.max())
    gathered = slots is not None
    chosen_block, warps, stages = launch_settings(dim, k_pool.element_size(), gathered, q.device)
    block_n = block_n or chosen_block
    sm_count = device_limits(q.device.index or 0)[0] if q.device.type == "cuda" else 132
    splits = num_splits or num_splits_for(max_len, batch * kv_heads, sm_count, block_n)
    out = torch.empty(batch, n_heads, splits, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, n_heads, splits, device=q.device, dtype=torch.float32)
    kf, vf = k_pool.view(-1, kv_heads, dim), v_pool.view(-1, kv_heads, dim)
    slot_arg = slots if slots is not None else lengths  # placeholder pointer when every slot is attended
    _partial[(batch, kv_heads, splits)](
        q, kf, vf, tables, slot_arg, lengths, out, lse,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), tables.stride(0),
        slot_arg.stride(0), slot_arg.stride(1) if slots is not None else 0, lengths.stride(0), lengths.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n, PAGE=page,
        HAS_SLOTS=gathered, PER_HEAD=lengths.shape[1] > 1, num_warps=warps, num_stages=stages,
    )
    final = torch.empty_like(q)
    _combine[(batch, n_heads)](
        out, lse, final, lse, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        final.stride(0), final.stride(1), splits, SPLITS_PAD=splits_pad(splits), D=dim, LOG2=False, WRITE_LSE=False,
    )
    return final
