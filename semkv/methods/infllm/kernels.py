"""infllm's kernels: Triton on CUDA, the torch reference (`reference.py` beside this file) elsewhere."""
from __future__ import annotations

from semkv.kernels import use_triton
from semkv.methods.infllm import reference


def block_slots(top, chosen, init, local, n, block_size, capacity):
    """See `reference.block_slots`."""
    if use_triton(top.device):
        from semkv.methods.infllm import triton_block_slots

        return triton_block_slots.block_slots(top, chosen, init, local, n, block_size, capacity)
    return reference.block_slots(top, chosen, init, local, n, block_size, capacity)
